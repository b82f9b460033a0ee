"""Data-parallel training: average a gradient tree, dense and sparse, across processes.

In data-parallel training every process (a *rank*) holds the same model and a
different shard of each batch.  Each rank computes the gradient of its own
shard's loss; averaging those gradients across the ranks before the optimizer
step gives every rank the gradient of the whole batch, so all ranks take the
same step and their models stay identical::

    group = mx.distributed.init()                       # under mlx.launch: every rank of the job
    loss, grads = seqlib.sparse.value_and_grad(model, loss_fn)(model, my_inputs, my_targets)
    grads = seqlib.distributed.average_gradients(grads, group)
    optimizer.update(model, grads)

Dense gradients are summed with ``mx.distributed.all_sum`` (as
:func:`mlx.nn.average_gradients` does, which this module calls).  A
:class:`~seqlib.sparse.SparseGradient` cannot be summed that way: each rank has
different rows.  Its rows are gathered from every rank with
``mx.distributed.all_gather`` instead, and duplicate rows are then summed.

:func:`launch_local` runs a script as a ring job of several processes on this
machine, as ``mlx.launch`` does, for trying such a program (and testing it) on
one computer.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from seqlib.sparse import SparseGradient

__all__ = ["average_gradients", "launch_local"]


def average_gradients(grads, group: mx.distributed.Group | None = None, all_reduce_size: int = 32 * 1024**2):
    """The mean of ``grads`` over the ranks of ``group``: dense arrays and :class:`SparseGradient` leaves.

    ``grads`` is a tree as :func:`mlx.nn.value_and_grad` or :func:`seqlib.sparse.value_and_grad`
    returns it (nested dicts, lists and tuples); every leaf must be a floating ``mx.array`` or a
    :class:`SparseGradient`, and every rank must pass a tree of the same structure (same names,
    leaf kinds, shapes and dtypes; a ValueError on every rank otherwise).  ``group`` defaults to
    ``mx.distributed.init()``; with one process the call checks ``grads`` and returns it unchanged.

    The math.  With R ranks, rank r's gradient ``g_r`` of the mean loss over its shard, every rank
    gets ``g = (g_1 + ... + g_R) / R``.  With equal shards of a batch of N examples,
    ``g_r = (R / N) * sum(grad loss_i for i in shard r)``, so ``g = (1 / N) * sum(grad loss_i for all
    N examples)``: the gradient one process computes on the whole batch.

    - **Dense leaves** (any shape): ``all_sum(g_r) / R``; small arrays are concatenated into buffers
      of up to ``all_reduce_size`` bytes, one collective each (:func:`mlx.nn.average_gradients`).
    - **Sparse leaves** of a (V, D) table: rank r holds rows ``I_r`` (U_r,) and values ``G_r``
      (U_r, D), and the U_r differ.  The counts are gathered first; each rank pads its rows to
      ``U_max = max_r U_r`` (row 0, zero values), ``all_gather`` concatenates them into (R U_max,)
      and (R U_max, D), and the padding is dropped.  Rows that several ranks touched are summed
      (:meth:`SparseGradient.coalesce`), then everything is divided by R: for every row v,
      ``g[v] = (sum of G_r[v] over the ranks r whose I_r holds v) / R``, which is row v of
      ``(to_dense(g_1) + ... + to_dense(g_R)) / R`` without building a (V, D) array.  The result is
      coalesced (sorted unique rows: the union of the ranks' rows), as
      :func:`seqlib.sparse.value_and_grad` gives it on the combined batch, so
      :class:`seqlib.optim.SparseAdam` touches the same rows as one process would.

    The mean equals the single-process gradient up to float32 summation order (R shard sums added
    instead of one sum over the batch; dividing by a power of two is exact).  Every rank receives
    bitwise the same result, so the ranks' models stay identical.
    """
    group = _check_group(group)
    leaves: list[mx.array | SparseGradient] = []
    layout: list[tuple] = []
    _collect_leaves(grads, "", leaves, layout)
    if group.size() == 1:
        return grads
    sparse = [leaf for leaf in leaves if isinstance(leaf, SparseGradient)]
    counts = _exchange_counts(layout, sparse, group)  # (R, number of sparse leaves)
    dense = [leaf for leaf in leaves if isinstance(leaf, mx.array)]
    averaged_dense = nn.average_gradients(dense, group=group, all_reduce_size=all_reduce_size) if dense else []
    averaged_sparse = [_average_sparse(leaf, counts[:, k], group) for k, leaf in enumerate(sparse)]
    dense_iter, sparse_iter = iter(averaged_dense), iter(averaged_sparse)
    return _rebuild(grads, lambda leaf: next(sparse_iter) if isinstance(leaf, SparseGradient) else next(dense_iter))


def _check_group(group) -> mx.distributed.Group:
    if group is None:
        return mx.distributed.init()
    if not isinstance(group, mx.distributed.Group):
        raise TypeError(f"group: expected an mlx.core.distributed.Group or None, got {type(group).__name__}")
    return group


def _collect_leaves(tree, path: str, leaves: list, layout: list) -> None:
    """Append ``tree``'s leaves to ``leaves`` in order, and their description to ``layout``; check each."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _collect_leaves(value, f"{path}.{key}" if path else str(key), leaves, layout)
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            _collect_leaves(value, f"{path}.{index}" if path else str(index), leaves, layout)
    elif isinstance(tree, SparseGradient):
        leaves.append(tree)
        layout.append((path, "sparse", tree.shape, str(tree.dtype)))
    elif isinstance(tree, mx.array):
        if not mx.issubdtype(tree.dtype, mx.floating):
            raise TypeError(f"grads[{path!r}]: expected a floating gradient, got an array of dtype {tree.dtype}")
        leaves.append(tree)
        layout.append((path, "dense", tuple(tree.shape), str(tree.dtype)))
    else:
        where = f"grads[{path!r}]" if path else "grads"
        raise TypeError(
            f"{where}: expected an mlx.core.array or a seqlib.sparse.SparseGradient "
            f"(in nested dicts, lists and tuples), got {type(tree).__name__}"
        )


def _rebuild(tree, average):
    """``tree`` with each leaf replaced by ``average(leaf)``, containers kept (dict, list, tuple)."""
    if isinstance(tree, dict):
        return {key: _rebuild(value, average) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(value, average) for value in tree)
    return average(tree)


def _exchange_counts(layout: list[tuple], sparse: list[SparseGradient], group) -> np.ndarray:
    """Every rank's row count of each sparse leaf, (R, len(sparse)); a ValueError if the trees differ."""
    fingerprint = zlib.crc32(repr(layout).encode()) & 0x7FFFFFFF  # the tree's names, kinds, shapes, dtypes
    mine = mx.array([fingerprint, *(leaf.indices.size for leaf in sparse)], mx.int32)  # (1 + S,)
    everyone = np.array(mx.distributed.all_gather(mine, group=group)).reshape(group.size(), -1)  # (R, 1 + S)
    if (everyone[:, 0] != fingerprint).any():
        raise ValueError(
            "grads: the ranks passed gradient trees of different structure (names, leaf kinds, shapes or "
            "dtypes); every rank must run the same model"
        )
    return everyone[:, 1:]


def _average_sparse(grad: SparseGradient, counts: np.ndarray, group) -> SparseGradient:
    """All ranks' rows of ``grad`` (``counts[r]`` from rank r), duplicates summed, divided by R."""
    size, most = group.size(), int(counts.max())
    if most == 0:  # no rank touched the table: the mean is empty too
        return grad
    padding = most - grad.indices.size
    indices = mx.concatenate([grad.indices.astype(mx.int32), mx.zeros((padding,), mx.int32)])  # (U_max,)
    values = mx.concatenate([grad.values, mx.zeros((padding, grad.shape[1]), grad.dtype)])  # (U_max, D)
    all_indices = mx.distributed.all_gather(indices, group=group)  # (R U_max,)
    all_values = mx.distributed.all_gather(values, group=group)  # (R U_max, D)
    real = np.concatenate([rank * most + np.arange(count) for rank, count in enumerate(counts)])  # drop padding
    real = mx.array(real.astype(np.int32))
    summed = SparseGradient(all_indices[real], all_values[real], grad.shape).coalesce()  # rows of every rank
    return SparseGradient(summed.indices, summed.values / size, grad.shape)


def launch_local(script, *args, ranks: int = 2, env: dict | None = None, timeout: float = 120.0,
                 attempts: int = 3) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``python script *args`` as ``ranks`` processes of one ring job on this machine.

    The command is ``mlx.launch --backend ring -n ranks --starting-port p python script *args``:
    rank r listens on ``127.0.0.1:p + r``, and ``mx.distributed.init()`` in the script joins the
    ring.  ``env`` adds to (or overrides) this process's environment.  Returns the launcher's
    ``CompletedProcess`` (text ``stdout`` with every rank's output, and ``stderr``) of the first
    attempt in which every rank exited 0.

    A ring can fail to form for reasons that have nothing to do with the script: on a shared
    machine another program may take a port between the check that it is free and the rank's bind.
    The ports are therefore chosen below the kernel's ephemeral range (from which every outgoing
    connection takes its local port), and a failed attempt is run again on other ports, up to
    ``attempts`` times in all.  The launcher exits 0 even when a rank fails; a rank that exited with
    an error, was killed, or a job that ran past ``timeout`` seconds (its processes are killed)
    counts as a failed attempt, reported with every rank that failed in it, in rank order.  A
    RuntimeError with every attempt's output if none succeeded.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: expected a positive int, got {ranks!r}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts: expected a positive int, got {attempts!r}")
    if not Path(script).is_file():
        raise FileNotFoundError(f"script: no such file {str(script)!r}")
    launcher = _launcher()
    environment = {**os.environ, **(env or {})}
    reports = []
    for attempt in range(1, attempts + 1):
        command = [launcher, "--backend", "ring", "-n", str(ranks), "--starting-port", str(_free_ports(ranks)),
                   sys.executable, str(script), *map(str, args)]  # fmt: skip
        result, failure = _run_job(command, environment, timeout)
        if failure is None:
            return result
        reports.append(f"attempt {attempt}: {failure}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
    raise RuntimeError(f"{script}: the {ranks}-rank job failed ({tries})\n" + "\n".join(reports))


def _launcher() -> str:
    """MLX's launcher: the ``mlx.launch`` installed beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise FileNotFoundError("mlx.launch (MLX's launcher for distributed jobs) was not found beside "
                                f"{sys.executable} nor on PATH")  # fmt: skip
    return found


def _run_job(command: list[str], environment: dict, timeout: float):
    """Run the launcher in its own process group; (its CompletedProcess, None or why the job failed)."""
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=environment, start_new_session=True) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and the ranks it started
            stdout, stderr = process.communicate()
            return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), f"ran past {timeout} s"
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if process.returncode != 0:
        return result, f"the launcher exited with {process.returncode}"
    # Every failed rank, in rank order: when one rank exits, the others may fail on the broken ring
    # before or after the launcher reports it, so the order of the reports says nothing.
    failed = re.findall(r"Node with rank (\d+) (exited with code -?\d+|was killed)", stderr)
    reports = [f"Node with rank {rank} {how}" for rank, how in sorted(set(failed), key=lambda f: int(f[0]))]
    return result, ("; ".join(reports) or None)


def _free_ports(count: int) -> int:
    """A port p with p, ..., p + count - 1 free on 127.0.0.1, below the ephemeral ports' range."""
    below = min(_ephemeral_ports_start(), 32768)  # 32768: Linux's default start
    if below < 21000 + count:  # a system whose ephemeral range starts this low: the retries must do
        below = 32768
    highest = below - count
    choose = random.Random()  # not the caller's seeded generator: concurrent jobs should differ
    for _ in range(100):
        port = choose.randrange(20000, highest)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 between 20000 and {highest + count}")


def _ephemeral_ports_start() -> int:
    """The first port of Linux's ephemeral range (ip_local_port_range); 49152 (IANA's, macOS's) elsewhere."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
