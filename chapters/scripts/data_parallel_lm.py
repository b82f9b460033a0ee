"""Chapter 18's data-parallel character language model: the program every rank runs.

    mlx.launch --backend ring -n 2 <python> data_parallel_lm.py OUT_DIR

Every rank builds the same model (chapter 13's, smaller: a sparse ``seqlib.nn.Embedding``, one
``seqlib.nn.LSTM`` layer, a linear head) from the same seed, reads its share of the B text streams
of every training window, and after each backward pass averages the gradients with
``seqlib.distributed.average_gradients``, so that every rank takes the step of the whole batch.
Rank r writes its parameters, losses and timings to ``OUT_DIR/rank<r>.npz``.  The chapter imports
:func:`train` and runs it in one process on the whole batch, to compare.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import seqlib

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from threadpoolctl import threadpool_limits

from seqlib import data

seqlib.route_mlx_blas()  # on Linux: MLX's matrix products on OpenBLAS, as in the book

BATCH, WINDOW, STEPS, EMBEDDING, HIDDEN = 32, 32, 12, 32, 128


class CharLanguageModel(nn.Module):
    """Chapter 13's model with one recurrent layer and a sparse embedding table."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.embedding = seqlib.nn.Embedding(vocab_size, EMBEDDING, sparse=True)
        self.recurrent = seqlib.nn.LSTM(EMBEDDING, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, vocab_size)

    def __call__(self, ids, state=None):  # ids (B, T) -> logits (B, T, V), state
        output, state = self.recurrent(self.embedding(ids), state)
        return self.head(output), state


def window_loss(model, inputs, targets, state):
    logits, state = model(inputs, state)
    return nn.losses.cross_entropy(logits, targets, reduction="mean"), state


def training_windows():
    """Chapter 13's training text (the standard-library modules, split by file) as TBPTT windows (B, L)."""
    train_files, _ = data.split_by_file(data.character_corpus(), validation_every=5)
    text = "\n".join(source for _, source in train_files)
    vocab = data.CharacterVocabulary(text, min_count=3)
    return len(vocab), data.tbptt_batches(vocab.encode(text), BATCH, WINDOW)


def arrays(tree):
    """Every array in a gradient tree, SparseGradient rows included (to evaluate them)."""
    leaves = [leaf for _, leaf in tree_flatten(tree)]
    return [part for leaf in leaves for part in ((leaf.indices, leaf.values) if hasattr(leaf, "values") else (leaf,))]


def train(group=None, steps: int = STEPS, shard: tuple[int, int] = (0, 1)):
    """Train on this rank's streams of every window.

    Returns the parameters, the losses, per-step timings (seconds), the table rows touched per step,
    and the first step's averaged gradient (every leaf dense, by name): the gradient, not only the
    parameters, because Adam would take nearly the same step from a gradient twice too large."""
    # (rank, size): this process's part of every batch; shard=(r, R) without a group computes
    # rank r's part alone, with no one to average with (what one rank costs, undisturbed)
    rank, size = (group.rank(), group.size()) if group is not None else shard
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)  # this rank's streams
    vocab_size, windows = training_windows()
    mx.random.seed(0)  # every rank starts from the same model
    model = CharLanguageModel(vocab_size)
    sparse_optimizer = seqlib.optim.SparseAdam(learning_rate=3e-3)
    dense_optimizer = optim.Adam(learning_rate=3e-3, bias_correction=True)  # torch's Adam
    loss_and_grad = seqlib.sparse.value_and_grad(model, window_loss)
    state, losses, rows_touched = None, [], []
    timings = {"compute": [], "average": [], "update": []}
    for step in range(steps):
        inputs, targets = windows[step]
        start = time.perf_counter()
        (loss, state), grads = loss_and_grad(model, inputs[rows], targets[rows], state)
        mx.eval(loss, state, arrays(grads))
        averaged = time.perf_counter()
        grads = seqlib.distributed.average_gradients(grads, group)  # the one line data parallelism adds
        mx.eval(arrays(grads))
        if step == 0:
            first_gradient = {name: np.array(g.to_dense() if hasattr(g, "to_dense") else g)
                              for name, g in tree_flatten(grads, is_leaf=lambda g: hasattr(g, "to_dense"))}
        updated = time.perf_counter()
        sparse_optimizer.update(model.embedding, grads["embedding"])
        dense_optimizer.update(model, {"recurrent": grads["recurrent"], "head": grads["head"]})
        state = tuple(mx.stop_gradient(s) for s in state)
        mx.eval(model.parameters(), sparse_optimizer.state, dense_optimizer.state, state)
        done = time.perf_counter()
        timings["compute"].append(averaged - start)
        timings["average"].append(updated - averaged)
        timings["update"].append(done - updated)
        losses.append(loss.item())
        rows_touched.append(grads["embedding"]["weight"].indices.size)
    parameters = {name: np.array(value) for name, value in tree_flatten(model.parameters())}
    timings = {name: np.array(values) for name, values in timings.items()}
    return parameters, np.array(losses), timings, rows_touched, first_gradient


def main(out_dir: Path) -> None:
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit("data_parallel_lm.py: run it under mlx.launch with at least 2 ranks")
    with threadpool_limits(1, user_api="blas"):  # one core per rank
        parameters, losses, timings, rows_touched, first_gradient = train(group)
    np.savez(out_dir / f"rank{group.rank()}.npz", losses=losses, rows_touched=np.array(rows_touched),
             **{f"param/{name}": value for name, value in parameters.items()},
             **{f"grad/{name}": value for name, value in first_gradient.items()},
             **{f"time/{name}": value for name, value in timings.items()})  # fmt: skip
    rank, size = group.rank(), group.size()
    first, last = rank * BATCH // size, (rank + 1) * BATCH // size - 1
    print(f"rank {rank} of {size}: {len(losses)} steps on streams {first}..{last}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
