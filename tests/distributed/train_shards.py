"""One rank of tests/test_distributed.py's data-parallel check; also the single-process reference.

Run under the launcher, one process per rank::

    mlx.launch --backend ring -n 2 <python> tests/distributed/train_shards.py OUT_DIR

Every rank trains the same small model (a sparse ``seqlib.nn.Embedding``, a ``seqlib.nn.GRU`` or
``LSTM``, a linear head) for a few steps on its shard of each batch, averaging the gradients with
``seqlib.distributed.average_gradients``, and writes its parameters and a few checks to
``OUT_DIR/<config>_rank<r>.npz``.  The test imports :func:`train` and runs it in one process on
the whole batches, which is what the ranks together must reproduce.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import seqlib

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers
import numpy as np
from mlx.utils import tree_flatten, tree_map

seqlib.route_mlx_blas()  # on Linux: MLX's matrix products on OpenBLAS, as in the book

VOCAB, DIM, HIDDEN, BATCH, LENGTH, STEPS = 40, 8, 16, 8, 6, 3
CONFIGS = ("adam", "sgd")  # GRU with SparseAdam + Adam; LSTM with seqlib.optim.SGD for every parameter
# SEQLIB_PLANT_SUM=1: the ranks sum their gradients instead of averaging them (the test shows it is caught)
PLANTED_BUG = os.environ.get("SEQLIB_PLANT_SUM") == "1"


class TinyModel(nn.Module):
    def __init__(self, recurrent):
        super().__init__()
        self.embedding = seqlib.nn.Embedding(VOCAB, DIM, padding_idx=0, sparse=True)
        self.recurrent = recurrent(DIM, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def __call__(self, ids):  # ids (B, T) -> logits (B, T, VOCAB)
        output, _ = self.recurrent(self.embedding(ids))
        return self.head(output)


def loss_fn(model, inputs, targets):
    return nn.losses.cross_entropy(model(inputs), targets, reduction="mean")


def batches():
    """STEPS batches of (inputs, targets), each (BATCH, LENGTH) int32.

    The first half of the rows reads ids 0..11 (few rows, the padding id 0 among them), the second
    half ids 8..39 (many rows): with two ranks, rank 0 touches fewer rows than rank 1, and rows
    8..11 are touched by both.
    """
    rng = np.random.default_rng(0)
    result = []
    for _ in range(STEPS):
        narrow = rng.integers(0, 12, size=(BATCH // 2, LENGTH + 1))
        wide = rng.integers(8, VOCAB, size=(BATCH - BATCH // 2, LENGTH + 1))
        ids = np.concatenate([narrow, wide]).astype(np.int32)
        result.append((mx.array(ids[:, :-1]), mx.array(ids[:, 1:])))
    return result


def train(config: str, group=None, rank: int = 0, size: int = 1):
    """Train ``config`` on shard ``rank`` of ``size`` of every batch.

    Returns the final parameters as NumPy arrays by name, with ``first_rows`` and ``first_values``: the
    (averaged) SparseGradient of the embedding at the first step, and, with several ranks, ``check_*`` values.
    """
    mx.random.seed(0)  # the same initial model on every rank
    recurrent = {"adam": seqlib.nn.GRU, "sgd": seqlib.nn.LSTM}[config]
    model = TinyModel(recurrent)
    if config == "adam":
        sparse_optimizer = seqlib.optim.SparseAdam(learning_rate=0.01)
        dense_optimizer = mlx.optimizers.Adam(learning_rate=0.01, bias_correction=True)  # as torch's Adam
    else:
        optimizer = seqlib.optim.SGD(learning_rate=0.5)
    loss_and_grad = seqlib.sparse.value_and_grad(model, loss_fn)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)  # this rank's shard
    results = {}
    for step, (inputs, targets) in enumerate(batches()):
        _, local = loss_and_grad(model, inputs[rows], targets[rows])
        grads = seqlib.distributed.average_gradients(local, group)
        if PLANTED_BUG and size > 1:  # the classic slip: the ranks' gradients summed, not averaged
            grads = tree_map(lambda g: seqlib.SparseGradient(g.indices, g.values * size, g.shape)
                             if isinstance(g, seqlib.SparseGradient) else g * size, grads,
                             is_leaf=lambda g: isinstance(g, seqlib.SparseGradient))  # fmt: skip
        if step == 0:
            first = grads["embedding"]["weight"]
            results = {"first_rows": np.array(first.indices), "first_values": np.array(first.values)}
            if size > 1:
                results.update(sparse_checks(local["embedding"]["weight"], first, group))
        if config == "adam":
            sparse_optimizer.update(model.embedding, grads["embedding"])
            dense_optimizer.update(model, {name: grads[name] for name in ("recurrent", "head")})
        else:
            optimizer.update(model, grads)
        mx.eval(model.parameters())
    return {name: np.array(value) for name, value in tree_flatten(model.parameters())} | results


def sparse_checks(local, averaged, group):
    """The averaged SparseGradient against the dense mean of every rank's table gradient."""
    dense_mean = mx.distributed.all_sum(local.to_dense(), group=group) / group.size()
    return {
        "check_rows_differ": np.array(
            np.array(mx.distributed.all_gather(mx.array([local.indices.size]), group=group)).tolist()
        ),
        "check_sparse_vs_dense_mean": np.array(mx.abs(averaged.to_dense() - dense_mean).max()),
        "check_coalesced": np.array(averaged.is_coalesced()),
    }


def structure_checks(group):
    """Containers survive (tuples stay tuples); different trees on different ranks are refused on every rank."""
    rank = group.rank()
    sparse = seqlib.SparseGradient(mx.array([rank]), mx.ones((1, 2)), (4, 2))
    tree = (mx.full((3,), float(rank)), [sparse, {"b": mx.ones((2, 2))}])
    averaged = seqlib.distributed.average_gradients(tree, group)
    kept = isinstance(averaged, tuple) and isinstance(averaged[1], list) and isinstance(averaged[1][1], dict)
    dense_ok = np.allclose(np.array(averaged[0]), (group.size() - 1) / 2)
    try:
        seqlib.distributed.average_gradients({"a": mx.ones((2 + rank,))}, group)
        refused = False
    except ValueError:
        refused = True
    return {"check_structure_kept": np.array(kept and dense_ok), "check_mismatch_refused": np.array(refused)}


def main(out_dir: Path) -> None:
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    if size < 2:
        raise SystemExit("train_shards.py: expected to run under mlx.launch with at least 2 ranks, got 1 process")
    for config in CONFIGS:
        results = train(config, group, rank, size)
        np.savez(out_dir / f"{config}_rank{rank}.npz", **results, **structure_checks(group))
    print(f"rank {rank} of {size}: done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
