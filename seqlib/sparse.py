"""Sparse gradients for embedding tables: train a huge table without a dense gradient.

A batch looks up a few thousand rows of a table that may have millions.  The
gradient of the table is zero everywhere else, so we never build it: for every
``Embedding`` / ``EmbeddingBag`` created with ``sparse=True``,
:func:`value_and_grad` returns a :class:`SparseGradient` — the unique rows that
were looked up and their gradient rows — and ordinary dense gradients for every
other parameter of the model, in one tree under the usual names::

    loss_and_grad = seqlib.sparse.value_and_grad(model, loss_fn)
    loss, grads = loss_and_grad(model, ids, targets)   # grads["embedding"]["weight"]: SparseGradient
    optimizer.update(model, grads)                      # seqlib.optim.SGD / Adagrad / SparseAdam

How: MLX can only differentiate with respect to function arguments, and which
rows a batch touches is known only once the model runs.  So the loss function
runs twice.  The first run is lazy and evaluates nothing but the index arrays
(the inputs): it records which rows each sparse table reads.  The second run
differentiates with respect to those rows, gathered into a small ``(U, D)``
array, and the dense parameters; the table itself is frozen during it.  The
cost is building the forward graph twice (Python overhead), never a
``(V, D)`` array.  ``loss_fn`` must look up the same rows both times (it may use
randomness elsewhere, such as dropout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["SparseGradient", "value_and_grad"]


@dataclass(frozen=True)
class SparseGradient:
    """The gradient of a (V, D) table as the rows that have one (torch's coalesced sparse grad)."""

    indices: mx.array  # (U,) sorted unique row ids
    values: mx.array  # (U, D) the gradient of those rows
    shape: tuple[int, ...]  # (V, D), the shape of the table

    @property
    def dtype(self) -> mx.Dtype:
        return self.values.dtype

    def to_dense(self) -> mx.array:
        """The (V, D) gradient it stands for (for tests and small tables)."""
        return mx.zeros(self.shape, self.values.dtype).at[self.indices].add(self.values)


@dataclass
class _Recording:
    """First run: the index arrays a sparse table was called with."""

    calls: list[np.ndarray] = field(default_factory=list)


@dataclass
class _Rows:
    """Second run: the differentiated rows (U, D) standing in for the table."""

    unique: np.ndarray  # (U,) the rows, sorted
    rows: mx.array | None = None


def lookup_table(module, input: mx.array):
    """What a sparse-capable module should look up from: ``(table, input, padding_idx)``.

    Normally that is ``(module.weight, input, module.padding_idx)``.  Inside
    :func:`value_and_grad` the first run records ``input``; the second returns
    the gathered rows and ``input`` renumbered into them.
    """
    state = getattr(module, "_sparse_state", None)
    if isinstance(state, _Recording):
        state.calls.append(np.asarray(input).reshape(-1))
    if not isinstance(state, _Rows):
        return module.weight, input, module.padding_idx
    flat = np.asarray(input)
    positions = np.searchsorted(state.unique, flat)
    found = positions < state.unique.size
    found[found] = state.unique[positions[found]] == flat[found]
    if not found.all():
        raise RuntimeError(
            "seqlib.sparse.value_and_grad: loss_fn looked up rows on its second run that it did not "
            "look up on its first; the rows a batch reads must not change between the two runs"
        )
    padding_idx = module.padding_idx
    if padding_idx is not None:
        at = int(np.searchsorted(state.unique, padding_idx))
        padding_idx = at if at < state.unique.size and state.unique[at] == padding_idx else None
    return state.rows, mx.array(positions.astype(np.int32)), padding_idx


def _sparse_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "sparse", False) and "weight" in module.trainable_parameters()
    ]


def value_and_grad(model: nn.Module, fn):
    """Like :func:`mlx.nn.value_and_grad`, with :class:`SparseGradient` for ``sparse=True`` tables."""

    def loss_and_grads(*args, **kwargs):
        tables = _sparse_tables(model)
        if not tables:
            return nn.value_and_grad(model, fn)(*args, **kwargs)
        try:
            unique_rows = _record_rows(tables, fn, args, kwargs)
            value, dense_grads, row_grads = _differentiate(model, tables, unique_rows, fn, args, kwargs)
        finally:
            for _, table in tables:
                table._sparse_state = None
        flat = tree_flatten(dense_grads)
        for (name, table), unique, grad in zip(tables, unique_rows, row_grads, strict=True):
            keep = unique != table.padding_idx if table.padding_idx is not None else np.ones(unique.size, bool)
            sparse_grad = SparseGradient(
                mx.array(unique[keep].astype(np.int32)), grad[mx.array(np.flatnonzero(keep))], table.weight.shape
            )
            flat.append((f"{name}.weight" if name else "weight", sparse_grad))
        return value, tree_unflatten(flat)

    return loss_and_grads


def _record_rows(tables, fn, args, kwargs) -> list[np.ndarray]:
    """First run: which rows does each sparse table read?  (Nothing but indices is evaluated.)"""
    for _, table in tables:
        table._sparse_state = _Recording()
    fn(*args, **kwargs)
    unique_rows = []
    for _, table in tables:
        calls = table._sparse_state.calls
        unique_rows.append(np.unique(np.concatenate(calls)) if calls else np.zeros(0, np.int64))
    return unique_rows


def _differentiate(model, tables, unique_rows, fn, args, kwargs):
    """Second run: gradients of the dense parameters and of the gathered rows."""
    states = [_Rows(unique) for unique in unique_rows]
    rows = [mx.take(table.weight, mx.array(unique.astype(np.int32)), axis=0) for (_, table), unique in
            zip(tables, unique_rows, strict=True)]  # fmt: skip

    def loss_of(dense_params, table_rows):
        model.update(dense_params)
        for (_, table), state, gathered in zip(tables, states, table_rows, strict=True):
            state.rows = gathered
            table._sparse_state = state
        return fn(*args, **kwargs)

    for _, table in tables:
        table.freeze(keys=["weight"])
    try:
        value, (dense_grads, row_grads) = mx.value_and_grad(loss_of, argnums=(0, 1))(
            model.trainable_parameters(), rows
        )
    finally:
        for _, table in tables:
            table.unfreeze(keys=["weight"])
    return value, dense_grads, row_grads
