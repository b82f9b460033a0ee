"""The benchmark harness: ``python -m seqlib.bench SUITE``.

Each *case* is one workload with several implementations (seqlib, plain MLX ops,
torch when it is installed).  The harness runs them **interleaved** — every
repeat times each implementation once, in a rotating order — so a noisy
neighbour on a shared machine slows all of them alike, and reports medians and
the ratios of each implementation's median to torch's and to plain MLX's.
Before each timed call it waits until the process's own threads are idle
(:func:`settle`): torch's OpenMP workers spin for milliseconds after each call,
and whichever implementation came next would share its cores with them.
Next to each time it prints the napkin math: the bytes a case must move at
least, and its FLOPs, as achieved GB/s and GFLOP/s; given this machine's own
limits (:mod:`seqlib.bench.machine`), also the roofline's time for the case
("limit ms") and each median over it ("x limit"), the matmul rate timed again with
every repeat of the case, interleaved with it.  Every implementation is
checked against the first one before anything is timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Case", "cpu_vector_extensions", "keep_large_buffers", "print_versions", "run_cases", "settle"]


@dataclass
class Case:
    name: str
    implementations: dict[str, Callable[[], object]]  # name -> function returning its result (evaluated)
    bytes_moved: float = 0.0  # a lower bound on the memory traffic, for GB/s
    flops: float = 0.0
    check: Callable[[object, object], float] | None = None  # max error of a result against the first's
    tolerance: float = 1e-4
    notes: list[str] = field(default_factory=list)
    mlx_baseline: str = "mlx ops"  # the implementation the "vs mlx" column divides by


def cpu_vector_extensions() -> str:
    """The CPU's model and vector extensions, as ``/proc/cpuinfo`` names them (AVX2, AVX-512, NEON, ...)."""
    import platform

    try:
        with open("/proc/cpuinfo") as file:
            info = file.read()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".strip()  # macOS: Apple silicon has NEON
    fields = {}
    for line in info.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        name, _, value = line.partition(":")
        fields[name.strip()] = value
    model = (fields.get("model name") or fields.get("CPU part") or platform.machine()).strip()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    wanted = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "asimd", "sve"]
    return f"{model}; vector extensions: {' '.join(flag for flag in wanted if flag in flags) or 'none listed'}"


_cache_limits: list[int] = []  # (before, after) once keep_large_buffers has run
_heap_kept: list[bool] = []  # [whether glibc's malloc took the settings] once keep_large_buffers has run
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 1 << 30, 2**31 - 1  # bytes: blocks up to 1 GB from the heap; never trim it


def keep_large_buffers() -> None:
    """Let freed buffers of any size be reused, for MLX and for torch alike: MLX's ``mx.set_cache_limit``
    raised to MLX's memory limit, and, under glibc, malloc told (``mallopt``) to serve blocks up to 1 GB from
    its heap and never to return the heap's free top to the system.

    On Linux MLX's CPU buffer cache holds 32 MB by default: a larger array goes back to the system when
    it is freed, and the next one takes a page fault on every 4 KB page it touches, about 0.75 ms per MB
    on our virtual machines (``x + 1`` on 40 MB: 34 ms, 5 ms with the cache raised).  A long sequence's
    gates pass 32 MB (LSTM, T = 1,600, B = 32, H = 128: 105 MB), and its per-step cost would grow with T
    for that alone.  The suites raise the limit, as a program that runs long sequences on the CPU should
    (README, Troubleshooting), and say so in their header.

    torch's CPU tensors come from malloc, which by default maps a large block afresh (and page-faults it)
    and trims the heap's free top, depending on what the process freed before: torch's LSTM forward+backward
    at (T, B, D, H) = (100, 32, 256, 512) took 123-135 ms with glibc's defaults and 103-109 with these
    settings (2-core Sapphire Rapids VM), so that a comparison without them flatters seqlib by up to a fifth.
    PyTorch's CPU tuning guide gets the same from jemalloc or tcmalloc; the suites ask glibc, in-process."""
    import mlx.core as mx

    if not _cache_limits:
        limit = mx.get_memory_limit()
        _cache_limits.extend([mx.set_cache_limit(limit), limit])
    if not _heap_kept:
        _heap_kept.append(_keep_malloc_heap())


def _keep_malloc_heap() -> bool:
    """glibc's malloc serves blocks up to _MMAP_THRESHOLD from its heap and never trims it; False where the C
    library is not glibc (macOS, musl) or refuses."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def print_versions() -> None:
    """The versions and settings a reader needs to compare timings, and the CPU they were taken on."""
    import importlib.util
    import os

    import mlx.core as mx

    import seqlib

    print(f"CPU: {cpu_vector_extensions()}, {os.cpu_count()} logical cores")
    blas = seqlib.blas_status()
    forced = {name: os.environ[name] for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if name in os.environ}
    settings = " ".join(f"{name}={value}" for name, value in forced.items())
    chosen = f", set in the environment: {settings}" if forced else ""
    kernels = f" (OpenBLAS's {blas.kernels} kernels{chosen})" if blas.kernels else ""
    print(f"seqlib {seqlib.__version__}, MLX {mx.__version__}, BLAS routed: {blas.routed}{kernels}, "
          f"C++ CPU primitives: {seqlib.native.available()} ({seqlib.native.reason()})")  # fmt: skip
    if _cache_limits:
        print(f"MLX buffer cache limit raised from {_cache_limits[0] >> 20} MB to {_cache_limits[1] >> 20} MB "
              f"(mx.set_cache_limit: large arrays are reused, not page-faulted anew)")  # fmt: skip
    if _heap_kept and _heap_kept[0]:
        print(f"glibc malloc keeps freed memory for reuse (mallopt: blocks up to {_MMAP_THRESHOLD >> 20} MB from the "
              "heap, no trimming): torch's large tensors are not page-faulted anew either")  # fmt: skip
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: no torch column")
        return
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, oneDNN: {torch.backends.mkldnn.enabled}")


def _median_seconds(samples: list[float]) -> float:
    return float(np.median(samples))


def settle(poll: float = 0.01, longest: float = 0.2) -> float:
    """Wait until this process's threads are idle (they used under a tenth of a core over ``poll`` seconds),
    at most ``longest`` seconds; returns the seconds waited.

    A library that runs on a thread pool may leave its workers spinning after a call returns, so that its
    next call finds them awake.  torch's OpenMP workers (GNU libgomp, ``GOMP_SPINCOUNT``) spin about 8 ms of
    CPU each after every call (an LSTM forward, 2-core Sapphire Rapids: 8.5 ms of CPU in a 50 ms sleep after
    it, against 0.1 ms after seqlib's).  Timed right after torch, another implementation shares its cores
    with those workers: on 16 cores seqlib's LSTM forward at (T, B, H) = (35, 20, 650) took 11.9 ms right
    after torch's call and 7.0 ms on its own.  Waiting before each call times every implementation on its
    own, torch included (its first parallel region then wakes its workers, tens of microseconds).  The poll
    is 10 ms because Linux adds another running thread's CPU time to the process's at scheduler ticks (up
    to 4 ms apart): over 2 ms a spinning worker can show none."""
    start = time.perf_counter()
    while time.perf_counter() - start < longest:
        cpu = time.process_time()
        time.sleep(poll)
        if time.process_time() - cpu < 0.1 * poll:
            break
    return time.perf_counter() - start


def _timed(function) -> float:
    """Seconds of one call of ``function``, once this process's threads are idle (settle)."""
    settle()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def run_cases(cases: list[Case], repeats: int = 15, warmup: int = 2, show: bool = True, machine=None) -> list[dict]:
    """Validate, then time every case; print a table per case (unless ``show`` is False) and return its rows.

    ``machine`` (a :class:`seqlib.bench.machine.Machine`): add each case's roofline time on it and each
    median over that time (``limit_ms``, ``vs_limit``; None where the case has no napkin math).  Where the machine
    was measured (its ``matmul``), that product runs once more after each repeat's implementations, and the case's
    matmul rate (``sgemm_GFLOP/s``) is that of its fastest run: the machine's speed while the case ran."""
    rows = []
    for case in cases:
        names = list(case.implementations)
        reference = case.implementations[names[0]]()
        for name in names[1:]:
            if case.check is not None:
                error = case.check(reference, case.implementations[name]())
                status = "ok" if error <= case.tolerance else "MISMATCH"
                if show or error > case.tolerance:
                    print(f"  check {case.name} / {name} vs {names[0]}: max error {error:.2e} [{status}]")
                if error > case.tolerance:
                    raise AssertionError(f"{case.name}: {name} disagrees with {names[0]} (max error {error:.2e})")
        del reference
        samples = {name: [] for name in names}
        matmul_times = []  # the machine's product, once per repeat
        for _ in range(warmup):
            for name in names:
                case.implementations[name]()
        for repeat in range(repeats):
            order = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in order:
                samples[name].append(_timed(case.implementations[name]))
            if machine is not None and machine.matmul is not None:
                matmul_times.append(_timed(machine.matmul))
        medians = {name: _median_seconds(times) for name, times in samples.items()}
        case_machine = machine.at_matmul_seconds(min(matmul_times)) if matmul_times else machine
        limit = case_machine.limit_seconds(case.flops, case.bytes_moved) if machine else 0.0
        for name in names:
            rows.append({
                "case": case.name, "implementation": name, "median_ms": 1e3 * medians[name],
                "vs_torch": medians[name] / medians["torch"] if "torch" in medians else None,
                "vs_mlx": medians[name] / medians[case.mlx_baseline] if case.mlx_baseline in medians else None,
                "GB/s": case.bytes_moved / medians[name] / 1e9 if case.bytes_moved else None,
                "GFLOP/s": case.flops / medians[name] / 1e9 if case.flops else None,
                "limit_ms": 1e3 * limit if limit else None,
                "vs_limit": medians[name] / limit if limit else None,
                "sgemm_GFLOP/s": case_machine.sgemm_flops / 1e9 if machine else None,
            })  # fmt: skip
        if show:
            _print_case(case, rows[-len(names):], limits=machine is not None)
    return rows


def _print_case(case: Case, rows: list[dict], limits: bool = False) -> None:
    def fmt(value, spec):
        width = spec.lstrip(">").split(".")[0]
        return format(value, spec) if value is not None else format("-", f">{width}")

    print(f"\n{case.name}")
    for note in case.notes:
        print(f"  {note}")
    vs_mlx = f"vs {case.mlx_baseline}"
    vs_width = max(12, len(vs_mlx) + 2)  # the column fits its header, however long the baseline's name
    limit_header = f"{'limit ms':>10}{'x limit':>9}" if limits else ""
    if limits:
        print(f"  limit at {rows[0]['sgemm_GFLOP/s']:.0f} GFLOP/s: the fastest of the matmuls timed with this case")
    print(f"  {'implementation':<26}{'median ms':>11}{'vs torch':>10}{vs_mlx:>{vs_width}}{'GB/s':>8}{'GFLOP/s':>9}"
          f"{limit_header}")  # fmt: skip
    for row in rows:
        limit_columns = f"{fmt(row['limit_ms'], '>10.2f')}{fmt(row['vs_limit'], '>9.2f')}" if limits else ""
        print(
            f"  {row['implementation']:<26}{row['median_ms']:>11.2f}{fmt(row['vs_torch'], '>10.2f')}"
            f"{fmt(row['vs_mlx'], f'>{vs_width}.2f')}{fmt(row['GB/s'], '>8.1f')}{fmt(row['GFLOP/s'], '>9.1f')}"
            f"{limit_columns}"
        )
