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
differentiates with respect to those rows, a small ``(U, D)`` array, and the
dense parameters; the table itself is frozen during it.  (With seqlib's C++
primitives the lookups read the rows from the table itself and the ``(U, D)``
array is never filled.)  The cost is building the forward graph twice (Python
overhead), never a ``(V, D)`` array.  ``loss_fn`` must look up the same rows both times (it may use
randomness elsewhere, such as dropout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from seqlib import native
from seqlib._checks import as_index_array, check_float_array, check_index_range, check_nonnegative_ints, check_weight
from seqlib._torch_arrays import to_mlx_array

__all__ = ["SparseGradient", "lookup_table", "value_and_grad"]


@dataclass(frozen=True, eq=False)
class SparseGradient:
    """The gradient of a (V, D) table as the rows that have one, like torch's sparse COO ``grad``.

    ``indices`` (U,) are row ids in ``[0, V)``, ``values`` (U, D) their gradient rows and
    ``shape`` the table's ``(V, D)``; NumPy arrays are accepted and stored as MLX arrays.
    Construction checks all three (an index outside ``[0, V)`` raises an IndexError), as
    ``torch.sparse_coo_tensor`` does with its invariant checks on.  Like torch's, the rows
    may repeat: a repeated row stands for the sum of its values (see :meth:`coalesce`,
    which the optimizers apply first).  :func:`value_and_grad` gives coalesced ones:
    sorted unique rows.  Two gradients compare equal only if they are the same object
    (compare their :meth:`to_dense` arrays for values).
    """

    indices: mx.array  # (U,) row ids in [0, V)
    values: mx.array  # (U, D) the gradient of those rows
    shape: tuple[int, ...]  # (V, D), the shape of the table
    _coalesced: bool | None = field(default=None, init=False, repr=False, compare=False)  # is_coalesced, cached

    def __post_init__(self):
        indices = as_index_array(self.indices, "indices")
        if indices.ndim != 1:
            raise ValueError(f"indices: expected a 1-D array of row ids, got shape {tuple(indices.shape)}")
        shape = _table_shape(self.shape)
        values = to_mlx_array(self.values, name="values")
        check_float_array(values, "values (len(indices), shape[1])", shape=(indices.size, shape[1]))
        check_index_range(indices, shape[0], "indices", "shape[0]")
        for name, value in (("indices", indices), ("values", values), ("shape", shape)):
            object.__setattr__(self, name, value)

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype of ``values`` (the table's dtype), as torch's ``grad.dtype``."""
        return self.values.dtype

    def is_coalesced(self) -> bool:
        """Whether ``indices`` are sorted and unique (each row once), as torch's ``is_coalesced``."""
        if self._coalesced is None:
            increasing = self.indices.size < 2 or mx.all(self.indices[1:] > self.indices[:-1]).item()
            object.__setattr__(self, "_coalesced", bool(increasing))
        return self._coalesced

    def coalesce(self) -> SparseGradient:
        """The same gradient with sorted unique rows, repeated rows' values summed (torch's ``coalesce``)."""
        if self.is_coalesced():
            return self
        unique, inverse = np.unique(np.asarray(self.indices), return_inverse=True)
        summed = mx.zeros((unique.size, self.shape[1]), self.dtype).at[mx.array(inverse.astype(np.int32))]
        return SparseGradient(mx.array(unique), summed.add(self.values), self.shape)

    def to_dense(self) -> mx.array:
        """The (V, D) gradient it stands for (for tests and small tables)."""
        return mx.zeros(self.shape, self.values.dtype).at[self.indices].add(self.values)


def _table_shape(shape) -> tuple[int, int]:
    """``shape`` as the table's ``(num_embeddings, embedding_dim)``, after checking it is one."""
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape: expected the table's (num_embeddings, embedding_dim), got {type(shape).__name__}")
    if len(shape) != 2:
        raise ValueError(f"shape: expected the table's (num_embeddings, embedding_dim), got {tuple(shape)}")
    check_nonnegative_ints(**{"shape[0]": shape[0], "shape[1]": shape[1]})
    return int(shape[0]), int(shape[1])


@dataclass
class _Recording:
    """First run: the index arrays a sparse table was called with."""

    calls: list[np.ndarray] = field(default_factory=list)


_MAP_ROWS_PER_LOOKUP = 16  # renumber through a (V,) map when V is at most this many times the rows read
_BITMAP_ROWS_PER_LOOKUP = 256  # seqlib.native's row bitmap (V / 8 bytes) when V is at most this many times


def _row_bitmaps(num_embeddings: int, lookups: int):
    """seqlib.native's row-set functions where they run and pay (V / 64 bitmap words against the
    ``lookups`` indices), else None: then NumPy sorts, maps and searches."""
    extension = native.extension()
    return extension if num_embeddings <= _BITMAP_ROWS_PER_LOOKUP * max(lookups, 1024) else None


def _native_ints(indices: np.ndarray) -> np.ndarray:
    """``indices`` as one contiguous int32 or int64 row, what seqlib.native's row-set functions take."""
    return np.ascontiguousarray(indices if indices.dtype in (np.int32, np.int64) else indices.astype(np.int64)).ravel()


@dataclass
class _Rows:
    """Second run: the differentiated rows (U, D) standing in for the table."""

    unique: np.ndarray  # (U,) the rows, sorted
    num_embeddings: int  # V, the table's rows
    lookups: int = 1  # how many times the first run looked the table up
    rows: mx.array | None = None
    position_of: np.ndarray | None = None  # (V,) where each table row is in `unique` (-1: not there), made once
    recorded: list[np.ndarray] = field(default_factory=list)  # the first run's lookups, flat, in call order
    recorded_positions: list[np.ndarray] | None = None  # their positions in `unique`, where the first run has them
    served: int = 0  # the second run's lookups so far

    def positions_of_call(self, input: np.ndarray) -> np.ndarray:
        """The second run's next lookup ``input`` renumbered into ``unique``: the first run's positions where
        that run's lookup of the same turn read the same indices, else :meth:`positions`.  A RuntimeError where
        ``input`` reads a row the first run did not."""
        call, self.served = self.served, self.served + 1
        if (self.recorded_positions is not None and call < len(self.recorded)
                and np.array_equal(self.recorded[call], input.reshape(-1))):  # fmt: skip
            return self.recorded_positions[call].reshape(input.shape)
        positions = self.positions(input)
        if positions.size and positions.min() < 0:
            raise RuntimeError(
                "seqlib.sparse.value_and_grad: loss_fn looked up rows on its second run that it did not "
                "look up on its first; the rows a batch reads must not change between the two runs"
            )
        return positions

    def positions(self, flat: np.ndarray) -> np.ndarray:
        """Where each of ``flat``'s rows is in ``unique``; -1 where it is not there (or not a row at all).

        For a table looked up once, seqlib.native's bitmap of the rows (O(V / 64 + U + N)) where it
        runs and V is within a factor of the rows read; else a (V,) map, filled in O(V) once for all
        lookups, where V is within a smaller factor; otherwise a binary search per index.
        """
        bitmaps = _row_bitmaps(self.num_embeddings, flat.size) if self.lookups == 1 else None
        if bitmaps is not None:
            unique = self.unique.astype(np.int32, copy=False)
            return bitmaps.row_positions(unique, _native_ints(flat), self.num_embeddings).reshape(flat.shape)
        if self.num_embeddings > _MAP_ROWS_PER_LOOKUP * max(self.unique.size, 1024):
            positions = np.searchsorted(self.unique, flat)
            found = positions < self.unique.size
            found[found] = self.unique[positions[found]] == flat[found]
            return np.where(found, positions, -1)
        if self.position_of is None:
            self.position_of = np.full(self.num_embeddings, -1, np.int32)
            self.position_of[self.unique] = np.arange(self.unique.size, dtype=np.int32)
        inside = (flat >= 0) & (flat < self.num_embeddings)
        if inside.all():
            return self.position_of[flat]
        return np.where(inside, self.position_of[np.where(inside, flat, 0)], -1)


def lookup_table(module, input: mx.array):
    """What a sparse-capable module should look up from: ``(table, input, padding_idx)``.

    Normally that is ``(module.weight, input, module.padding_idx)``.  Inside
    :func:`value_and_grad` the first run records ``input``; the second returns
    the gathered rows and ``input`` renumbered into them.  ``module`` needs a
    (V, D) ``weight`` and a ``padding_idx`` (an int in [0, V) or None), and
    ``input`` must hold integers (a TypeError otherwise); their range is the
    caller's to check, and :func:`value_and_grad` checks the rows it gathers.
    """
    _check_table_module(module)
    input = as_index_array(input, "input")
    state = getattr(module, "sparse_recording", None)
    if isinstance(state, _Recording):
        state.calls.append(np.asarray(input).reshape(-1))
    if not isinstance(state, _Rows):
        return module.weight, input, module.padding_idx
    positions = state.positions_of_call(np.asarray(input))
    padding_idx = module.padding_idx
    if padding_idx is not None:
        at = int(np.searchsorted(state.unique, padding_idx))
        padding_idx = at if at < state.unique.size and state.unique[at] == padding_idx else None
    return state.rows, mx.array(positions.astype(np.int32, copy=False)), padding_idx


def _check_table_module(module) -> None:
    if not isinstance(getattr(module, "weight", None), mx.array) or not hasattr(module, "padding_idx"):
        raise TypeError(
            "module: expected a table with a (V, D) weight and a padding_idx (such as seqlib.nn.Embedding), "
            f"got {type(module).__name__}"
        )
    check_weight(module.weight, "module.weight")


def _sparse_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sparse=True tables that look up through :func:`lookup_table` (they carry ``sparse_recording``)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "sparse", False) and hasattr(module, "sparse_recording")
        and "weight" in module.trainable_parameters()
    ]  # fmt: skip


def _scalar_loss(fn):
    """``fn``, checking that it returns a scalar floating loss (or a tuple that starts with one)."""

    def loss(*args, **kwargs):
        output = fn(*args, **kwargs)
        value = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.floating):
            got = value.dtype if isinstance(value, mx.array) else type(value).__name__
            raise TypeError(f"fn: must return a floating mlx.core.array loss (or a tuple starting with one), got {got}")
        if value.ndim != 0:
            raise ValueError(f"fn: must return a scalar loss (shape ()), got shape {tuple(value.shape)}")
        return output

    return loss


def value_and_grad(model: nn.Module, fn):
    """Like :func:`mlx.nn.value_and_grad`, with :class:`SparseGradient` for ``sparse=True`` tables.

    ``fn`` must return a scalar (shape ``()``) floating loss, or a tuple starting with
    one, as MLX requires (torch also takes a one-element loss such as shape ``(1,)``;
    here that is a ValueError).  A table that looks up no rows (an empty batch) gets
    an empty :class:`SparseGradient`, as torch's sparse ``grad`` has no entries then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an mlx.nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable returning the loss, got {type(fn).__name__}")
    fn = _scalar_loss(fn)

    def loss_and_grads(*args, **kwargs):
        tables = _sparse_tables(model)
        if not tables:
            return nn.value_and_grad(model, fn)(*args, **kwargs)
        try:
            states = _record_rows(tables, fn, args, kwargs)
            value, dense_grads, row_grads = _differentiate(model, tables, states, fn, args, kwargs)
        finally:
            for _, table in tables:
                table.sparse_recording = None
        flat = tree_flatten(dense_grads)
        for (name, table), state, grad in zip(tables, states, row_grads, strict=True):
            flat.append((f"{name}.weight" if name else "weight", _row_gradient(table, state.unique, grad)))
        return value, tree_unflatten(flat)

    return loss_and_grads


def _row_gradient(table, unique: np.ndarray, grad: mx.array) -> SparseGradient:
    """The SparseGradient of ``table`` from the gradient (U, D) of its rows ``unique`` (sorted, distinct, in
    [0, V): :func:`_sorted_unique`'s, so not checked again), less the padding row, which gets none."""
    if unique.size == 0:  # no rows read: drop _row_argument's stand-in row
        grad = grad[:0]
    elif table.padding_idx is not None and table.padding_idx in unique:
        keep = unique != table.padding_idx
        unique, grad = unique[keep], grad[mx.array(np.flatnonzero(keep))]
    gradient = object.__new__(SparseGradient)  # the dataclass's fields, without __post_init__'s checks
    fields = {"indices": mx.array(unique.astype(np.int32, copy=False)), "values": grad,
              "shape": tuple(table.weight.shape), "_coalesced": True}  # fmt: skip
    for name, value in fields.items():
        object.__setattr__(gradient, name, value)
    return gradient


def _record_rows(tables, fn, args, kwargs) -> list[_Rows]:
    """First run: which rows does each sparse table read?  (Nothing but indices is evaluated.)"""
    for _, table in tables:
        table.sparse_recording = _Recording()
    fn(*args, **kwargs)
    states = []
    for name, table in tables:
        calls = table.sparse_recording.calls
        flat = calls[0] if len(calls) == 1 else np.concatenate(calls) if calls else np.zeros(0, np.int64)
        num_embeddings = table.weight.shape[0]
        unique, positions = _sorted_unique(flat, num_embeddings, f"input of {name or 'model'}")
        if positions is not None:  # each lookup's share, in call order
            positions = np.split(positions, np.cumsum([call.size for call in calls[:-1]]))
        states.append(_Rows(unique, num_embeddings, lookups=len(calls), recorded=calls, recorded_positions=positions))
    return states


def _sorted_unique(indices: np.ndarray, num_embeddings: int, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``np.unique(indices)`` after checking that every index lies in [0, V) (an IndexError naming ``name``),
    and where each index is among the unique rows, or None.  seqlib.native's bitmap of the rows gives both where
    it runs and pays; else one sort gives the rows (NumPy 2's hashing unique is about 20x slower on 80k
    indices) and the second run finds the positions (:meth:`_Rows.positions`)."""
    bitmaps = _row_bitmaps(num_embeddings, indices.size)
    if bitmaps is not None:
        try:
            return bitmaps.unique_rows(_native_ints(indices), num_embeddings)
        except IndexError:
            check_index_range(indices, num_embeddings, name)  # the message of every lookup
            raise
    check_index_range(indices, num_embeddings, name)
    ordered = np.sort(indices)
    return (ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered), None


def _differentiate(model, tables, states, fn, args, kwargs):
    """Second run: gradients of the dense parameters and of the rows read (see :func:`_row_argument`)."""
    arguments, rows_of = [], []  # what is differentiated for each table, and the rows its lookups read from it
    for (_, table), state in zip(tables, states, strict=True):
        argument, rows = _row_argument(table.weight, state.unique)
        arguments.append(argument)
        rows_of.append(rows)

    def loss_of(dense_params, table_arguments):
        model.update(dense_params)
        for (_, table), state, argument, rows in zip(tables, states, table_arguments, rows_of, strict=True):
            state.rows, state.served = rows(argument), 0
            table.sparse_recording = state
        return fn(*args, **kwargs)

    for _, table in tables:
        table.freeze(keys=["weight"])
    try:
        value, (dense_grads, row_grads) = mx.value_and_grad(loss_of, argnums=(0, 1))(
            model.trainable_parameters(), arguments
        )
    finally:
        for _, table in tables:
            table.unfreeze(keys=["weight"])
    return value, dense_grads, row_grads


def _row_argument(weight: mx.array, unique: np.ndarray):
    """What the second run differentiates for a table whose rows ``unique`` (checked by :func:`_record_rows`) are
    read, (U, D), and the function from it to the rows the lookups read.

    Where seqlib.native serves, a broadcast of zeros (no memory) and seqlib.native's ``sparse_rows`` of it: the
    rows ``weight[unique]``, which the native bag and gather read from ``weight`` itself, so that they are never
    copied out (see ``sparse_rows`` in bags_cpu.cpp); elsewhere the gathered rows themselves.  With no rows read,
    one unread zero row (MLX cannot differentiate a lookup into a (0, D) array; its gradient is dropped)."""
    if unique.size == 0:
        return mx.zeros((1, weight.shape[1]), weight.dtype), lambda rows: rows
    rows = mx.array(unique.astype(np.int32, copy=False))
    if native.serves(weight.dtype):
        delta = mx.broadcast_to(mx.array(0, weight.dtype), (unique.size, weight.shape[1]))
        return delta, lambda delta: native.extension().sparse_rows(weight, rows, delta)
    return mx.take(weight, rows, axis=0), lambda rows: rows
