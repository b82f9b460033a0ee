"""Functional forms of seqlib's layers (and the cross-entropy loss, :mod:`seqlib.losses`), with PyTorch's
signatures.

Like ``torch.nn.functional``, these take the weights as arguments and hold no
state.  The modules in :mod:`seqlib.nn` call them.  Which implementation runs is
:func:`seqlib.dispatch.path_for`'s choice: seqlib's Metal kernels (``"kernels"``), its C++
CPU primitives for float32 bags (``"native"``), or the MLX ops below (``"ops"``, and
``"plain"``: built-in primitives only, for ``mx.export_function``).

Index arrays are checked without forcing an evaluation (:mod:`seqlib.graph`): where their
values are already on the host (NumPy, an evaluated array) at the call, with an IndexError
or ValueError there; where they are lazy or traced (inside ``mx.compile``, ``mx.vmap``, a lazy
program), in the graph, by seqlib's checking primitives, whose error MLX raises (as a
RuntimeError with the same message) where the result is evaluated.  On the ``"plain"`` path,
and where seqlib's extension cannot be built, a lazy index outside the table reads a row of
NaN instead (and a bag with one, or with bad offsets, is NaN).  No path ever reads or writes
outside the table.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from seqlib import native
from seqlib.dispatch import path_for
from seqlib.graph import graph_checks, host_values
from seqlib.kernels import bag_kernels, embedding_kernels
from seqlib.losses import cross_entropy
from seqlib._bags import BAG_MODES, bag_bounds, bag_layout, check_bag_mode, flatten_bags
from seqlib._checks import (
    as_index_array,
    check_index_range,
    check_max_norm,
    check_per_sample_weights,
    check_weight,
    normalize_padding_idx,
)

__all__ = [
    "cross_entropy",
    "embedding",
    "embedding_bag",
    "embedding_renorm",
    "pool_rows",
    "quantized_embedding",
    "quantized_embedding_bag",
    "renorm_for_lookup",
]

def _checked_indices(indices: mx.array, upper: int, path: str, name: str = "input") -> tuple[mx.array, mx.array | None]:
    """``indices`` ready to read a table of ``upper`` rows, never out of bounds, and a mask of the ones
    outside it where only NaN rows can tell (else None).  See the module's docstring."""
    values = host_values(indices)
    if values is not None:
        check_index_range(values, upper, name)
        return indices, None
    extension = graph_checks(path)
    if extension is not None:
        return extension.checked_indices(indices, upper, name, "num_embeddings"), None
    outside = (indices < 0) | (indices >= upper)
    return mx.clip(indices, 0, max(upper - 1, 0)), outside


def _checked_bounds(offsets, input_size: int, include_last_offset: bool, path: str) -> tuple[mx.array, mx.array | None]:
    """The bags' bounds (B + 1,) int32 from ``offsets`` (torch's rules, see :func:`seqlib._bags.bag_bounds`),
    and a scalar that is True where only NaN can tell that the offsets broke them (else None)."""
    values = host_values(offsets)
    if values is not None:
        return mx.array(bag_bounds(values, input_size, include_last_offset, np.int32)), None
    extension = graph_checks(path)
    if extension is not None:
        return extension.checked_bounds(offsets, input_size, include_last_offset), None
    bounds = offsets.astype(mx.int32)
    if not include_last_offset:
        bounds = mx.concatenate([bounds, mx.array([input_size], mx.int32)])
    broken = (bounds[0] != 0) | (bounds[-1] != input_size) | mx.any(bounds[1:] < bounds[:-1])
    broken = broken | mx.any(bounds > input_size)
    return mx.clip(mx.cummax(bounds), 0, input_size), broken


def _with_nan_rows(rows: mx.array, outside: mx.array | None) -> mx.array:
    """``rows`` (*, D) with NaN where ``outside`` (*) is True: the safe answer for an index outside the table."""
    if outside is None:
        return rows
    return mx.where(mx.expand_dims(outside, -1), mx.array(float("nan"), rows.dtype), rows)


def _native_serves(weight: mx.array, indices: mx.array) -> bool:
    """Whether a bag over ``weight`` pools in seqlib.native's C++ primitive (float32, int32-sized, built here)."""
    return max(weight.shape[0], indices.size) < 2**31 and path_for(weight.dtype) == "native"


def _take_rows(weight: mx.array, indices: mx.array, path: str) -> mx.array:
    """``weight[indices]``, (*) -> (*, D), with its gradient: seqlib.native's gather where it serves (each row
    one copy, the next rows prefetched, on every core; MLX's CPU gather moves one float at a time), else
    ``mx.take``.  ``indices`` lie in [0, V) (checked by the caller)."""
    if path == "native" and _native_serves(weight, indices):
        return native.extension().take_rows(weight, indices.astype(mx.int32))
    return mx.take(weight, indices, axis=0)


def _native_pool(weight, indices, bounds, mode, entry_weights, padding_idx) -> mx.array:
    """:func:`seqlib.kernels.bag_kernels.pool_bags`'s contract on seqlib.native's CPU primitive.

    weight (V, D) float32; indices (N,) int32 in [0, V); bounds (B + 1,) int32; entry_weights (N,) or None.
    """
    mode_id, padding = BAG_MODES.index(mode), -1 if padding_idx is None else padding_idx
    return native.extension().bag_pool(weight, indices, bounds, entry_weights, mode_id, padding)  # with its vjp


def _row_norms(rows: mx.array, norm_type: float) -> mx.array:
    """The ``norm_type``-norm of each row of ``rows`` (n, D), computed in float32."""
    rows = mx.abs(rows.astype(mx.float32))
    if math.isinf(norm_type):
        return mx.max(rows, axis=-1)
    if norm_type == 1:
        return mx.sum(rows, axis=-1)
    if norm_type == 2:
        return mx.sqrt(mx.sum(rows * rows, axis=-1))
    return mx.power(mx.sum(mx.power(rows, norm_type), axis=-1), 1.0 / norm_type)


def embedding_renorm(weight: mx.array, input: mx.array, max_norm: float, norm_type: float = 2.0) -> mx.array:
    """Return ``weight`` with every row that ``input`` looks up scaled to norm <= ``max_norm``.

    This is torch's in-place ``embedding_renorm_`` written functionally: each
    *looked-up* row whose norm exceeds ``max_norm`` is multiplied by
    ``max_norm / (norm + 1e-7)``; all other rows are returned unchanged.
    ``max_norm`` must be a number >= 0 (torch's negative values flip rows' signs:
    refused), ``norm_type`` > 0.
    """
    check_weight(weight)
    check_max_norm(max_norm, norm_type, required=True)
    path = path_for(weight.dtype)
    indices, outside = _checked_indices(as_index_array(input, "input"), weight.shape[0], path)
    values = host_values(indices)
    if values is None:  # lazy or traced: rescale every occurrence's row, the same value for a repeated row
        return _renorm_rows_in_graph(weight, indices.reshape(-1), max_norm, norm_type, outside)
    unique_rows = mx.array(np.unique(values.reshape(-1)).astype(np.int32))
    if unique_rows.size == 0 or weight.size == 0:  # nothing to rescale (MLX cannot scatter into an empty table)
        return weight
    if path == "kernels":
        scale = embedding_kernels.renorm_scales(weight, unique_rows, max_norm, norm_type)  # checked above
    else:
        scale = _renorm_scales(weight[unique_rows], max_norm, norm_type)
    return weight.at[unique_rows].multiply(scale[:, None].astype(weight.dtype))


def _renorm_scales(rows: mx.array, max_norm: float, norm_type: float) -> mx.array:
    norms = _row_norms(rows, norm_type)  # (n,)
    return mx.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)


def _renorm_rows_in_graph(weight, flat, max_norm, norm_type, outside) -> mx.array:
    """:func:`embedding_renorm` for indices known only in the graph: each occurrence writes its rescaled row
    (a repeated row writes the same values), so nothing depends on the indices' values at the call."""
    if flat.size == 0 or weight.size == 0:
        return weight
    rows = mx.take(weight, flat, axis=0)
    scale = _renorm_scales(rows, max_norm, norm_type)
    if outside is not None:  # a clamped index leaves its row as it is
        scale = mx.where(outside.reshape(-1), 1.0, scale)
    row_scale = mx.ones((weight.shape[0],), scale.dtype).at[flat].minimum(scale)  # one scale per table row
    scaled = rows * row_scale[flat][:, None].astype(weight.dtype)
    return mx.put_along_axis(weight, flat[:, None], scaled, axis=0)


@mx.custom_function
def _straight_through(weight: mx.array, replacement: mx.array) -> mx.array:
    """Forward: ``replacement``.  Backward: the gradient goes to ``weight`` unchanged."""
    return replacement


@_straight_through.vjp
def _straight_through_vjp(primals, cotangent, output):
    _, replacement = primals
    return cotangent, mx.zeros_like(replacement)


def renorm_for_lookup(weight: mx.array, input: mx.array, max_norm: float, norm_type: float = 2.0) -> mx.array:
    """:func:`embedding_renorm`'s values, with the gradient passed to ``weight`` unchanged.

    torch renormalises under ``no_grad``, so a lookup's gradient reaches ``weight``
    as if the renormalisation had not happened; this reproduces that.
    """
    renormed = mx.stop_gradient(embedding_renorm(weight, input, max_norm, norm_type))
    if path_for(weight.dtype) == "plain":  # built-in ops only: renormed + 0, with weight's gradient
        return renormed + (weight - mx.stop_gradient(weight))
    return _straight_through(weight, renormed)


@mx.custom_function
def _scale_gradient(x: mx.array, scale: mx.array) -> mx.array:
    """Forward: ``x`` unchanged.  Backward: the gradient times ``scale`` (broadcast to x)."""
    return x


@_scale_gradient.vjp
def _scale_gradient_vjp(primals, cotangent, output):
    _, scale = primals
    return (cotangent * scale).astype(cotangent.dtype), mx.zeros_like(scale)


def _scaled_gradient(x: mx.array, scale: mx.array) -> mx.array:
    """``x`` unchanged, its gradient times ``scale`` (broadcast to x): a custom function, or on the
    ``"plain"`` path the same from built-in ops (``x`` + 0, with ``(x - x) * scale`` carrying the gradient)."""
    if path_for(x.dtype) != "plain":
        return _scale_gradient(x, scale)
    frozen = mx.stop_gradient(x)
    return frozen + ((x - frozen) * scale).astype(x.dtype)


def _inverse_frequency(indices: mx.array, num_embeddings: int) -> mx.array:
    """For each index, 1 / (how often it occurs in ``indices``): torch's ``scale_grad_by_freq``."""
    values = host_values(indices)
    if values is None:  # in the graph: a count per table row
        counts = mx.zeros((num_embeddings,), mx.float32).at[indices.reshape(-1)].add(1.0)
        return (1.0 / counts)[indices]
    _, inverse, counts = np.unique(values.reshape(-1), return_inverse=True, return_counts=True)
    return mx.array((1.0 / counts[inverse]).astype(np.float32).reshape(indices.shape))


def embedding(
    input: mx.array,
    weight: mx.array,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> mx.array:
    """Look up rows of ``weight`` (V, D) for integer ``input`` of any shape: ``(*) -> (*, D)``.

    - ``padding_idx``: lookups of that row return its values but send it no gradient.
    - ``max_norm``: looked-up rows are first renormalised as by :func:`embedding_renorm`.
      torch does this to ``weight`` in place; MLX arrays are immutable, so here the
      lookup reads a renormalised copy and the gradient flows to ``weight`` as if the
      renormalisation were the identity (as in torch, where it runs under ``no_grad``).
      :class:`seqlib.nn.Embedding` stores the renormalised copy as its new weight.
    - ``scale_grad_by_freq``: each occurrence's gradient is divided by how often its
      index occurs in ``input``.
    - ``sparse`` is accepted for torch's signature; a functional call has no weight to
      own a sparse gradient, so see :func:`seqlib.sparse.value_and_grad` for modules.

    ``input`` is an MLX or NumPy array of any integer dtype (torch: int32/int64 tensors);
    unlike torch, a negative ``max_norm`` and a ``norm_type`` <= 0 raise a ValueError.
    """
    check_weight(weight)
    num_embeddings, path = weight.shape[0], path_for(weight.dtype)
    indices, outside = _checked_indices(as_index_array(input, "input"), num_embeddings, path)
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    check_max_norm(max_norm, norm_type)
    if weight.size == 0:  # V or D is 0: nothing to read (and MLX cannot scatter a gradient into it)
        return mx.zeros((*indices.shape, weight.shape[1]), weight.dtype)

    if max_norm is not None:
        weight = renorm_for_lookup(weight, indices, max_norm, norm_type)
    if path == "kernels":
        grad_scale = _inverse_frequency(indices, num_embeddings).reshape(-1) if scale_grad_by_freq else None
        return _with_nan_rows(embedding_kernels.gather_rows(weight, indices, padding_idx, grad_scale), outside)
    rows = _with_nan_rows(_take_rows(weight, indices, path), outside)  # (*, D)
    if padding_idx is None and not scale_grad_by_freq:
        return rows
    grad_scale = mx.ones(indices.shape, dtype=mx.float32)
    if scale_grad_by_freq:
        grad_scale = _inverse_frequency(indices, num_embeddings)
    if padding_idx is not None:
        grad_scale = mx.where(indices == padding_idx, 0.0, grad_scale)
    return _scaled_gradient(rows, mx.expand_dims(grad_scale, -1))


def _max_winners(rows: mx.array) -> mx.array:
    """For (n, length, D) rows of n bags, the entry each column's max comes from: (n, D).

    torch's rule (its CPU kernel, and seqlib's Metal kernel): start at the bag's first
    entry and move only to a strictly greater value.  So the first of equal values wins,
    and NaN (never greater, nor less) wins only as the first entry: later NaNs are skipped.
    """
    winners = mx.argmax(mx.where(mx.isnan(rows), -mx.inf, rows), axis=1)  # first of the largest non-NaNs
    return mx.where(mx.isnan(rows[:, 0]), 0, winners)


def _reduce_bucket(rows: mx.array, weights: mx.array | None, mode: str) -> mx.array:
    """Reduce (n, length, D) rows of n equally long bags to (n, D)."""
    if mode == "max":  # its gradient goes to the same entry: see _max_entries_gradient
        return mx.take_along_axis(rows, mx.expand_dims(_max_winners(rows), 1), axis=1).squeeze(1)
    if weights is not None:
        rows = rows * weights[..., None]
    total = mx.sum(rows, axis=1)
    return total / rows.shape[1] if mode == "mean" else total


def _pool_buckets(rows: mx.array, entry_weights: mx.array | None, shapes: list[tuple[int, int]], mode: str):
    """Pool (N', D) rows listed bucket by bucket into one (bags, D) row per non-empty bag.

    The forward splits the rows into one (bags, length, D) block per bucket and
    reduces each.  The backward is written out by hand: autodiff through
    ``mx.split`` would build a full (N', D) gradient for every block (0.9 s for 40
    buckets at N'=85k, D=128), whereas every entry's gradient is simply its bag's
    output gradient, times its weight (``sum``) or 1 / the bag size (``mean``),
    or sent to the arg-max entry alone (``max``).
    """
    num_rows, embedding_dim = rows.shape
    boundaries = np.cumsum([bags * length for bags, length in shapes])[:-1].tolist()
    lengths = np.concatenate([np.full(bags, length) for bags, length in shapes])  # per pooled bag
    weighted = entry_weights is not None
    entry_weights = entry_weights if weighted else mx.ones((num_rows,), rows.dtype)

    def blocks(array: mx.array) -> list[mx.array]:
        return mx.split(array, boundaries) if boundaries else [array]

    @mx.custom_function
    def pool(rows, entry_weights):
        pooled = []
        for row_block, weight_block, (bags, length) in zip(blocks(rows), blocks(entry_weights), shapes, strict=True):
            block_weights = weight_block.reshape(bags, length) if weighted else None
            pooled.append(_reduce_bucket(row_block.reshape(bags, length, embedding_dim), block_weights, mode))
        return mx.concatenate(pooled, axis=0)

    @pool.vjp
    def pool_vjp(primals, cotangent, output):
        rows, entry_weights = primals
        if mode == "max":
            return _max_entries_gradient(rows, cotangent, blocks(rows), shapes), mx.zeros_like(entry_weights)
        bag_of_entry = mx.array(np.repeat(np.arange(lengths.size), lengths).astype(np.int32))
        spread = mx.take(cotangent, bag_of_entry, axis=0)  # (N', D): each entry gets its bag's gradient
        no_weight_grad = mx.zeros_like(entry_weights)
        if mode == "mean":
            bag_size = mx.array(np.repeat(lengths, lengths).astype(np.float32))[:, None]
            return spread * (1 / bag_size), no_weight_grad  # times 1 / size, as torch's backward (and its bits)
        if not weighted:
            return spread, no_weight_grad
        return spread * entry_weights[:, None], mx.sum(spread * rows, axis=1)

    return pool(rows, entry_weights)


def _max_entries_gradient(rows, cotangent, row_blocks, shapes) -> mx.array:
    """Scatter each bag's output gradient onto the entry that won its max (see _max_winners)."""
    num_rows, embedding_dim = rows.shape
    columns = mx.arange(embedding_dim)
    targets, first_entry = [], 0
    for block, (bags, length) in zip(row_blocks, shapes, strict=True):
        winner = _max_winners(block.reshape(bags, length, embedding_dim))  # (bags, D)
        entry = first_entry + mx.arange(bags)[:, None] * length + winner
        targets.append((entry * embedding_dim + columns).reshape(-1))
        first_entry += bags * length
    flat = mx.zeros((num_rows * embedding_dim,), cotangent.dtype).at[mx.concatenate(targets)].add(
        cotangent.reshape(-1))  # fmt: skip
    return flat.reshape(num_rows, embedding_dim)


def embedding_bag(
    input: mx.array,
    weight: mx.array,
    offsets: mx.array | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: mx.array | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> mx.array:
    """Sum, average or max-pool bags of embedding rows without building the (N, D) lookup.

    Bags come as a 2-D ``input`` (B, N) — one bag per row — or as a 1-D ``input`` with
    ``offsets`` (B,) giving where each bag starts (with ``include_last_offset=True``,
    ``offsets`` has B + 1 entries and the last one is where the last bag ends).
    Entries equal to ``padding_idx`` are left out (not counted by ``mean``); an empty
    bag gives zeros in every mode.  ``per_sample_weights`` (the shape of ``input``, the
    dtype of ``weight``) weight each entry, in ``mode="sum"`` only.  Returns (B, D).

    ``mode="max"`` follows torch's CPU kernel: each column starts at the bag's first
    entry and moves only to a strictly greater value, so a NaN is the result only where
    it is the first entry, and the gradient goes to the entry that won.  Empty inputs
    give empty results as in torch: (0, N) or empty ``offsets`` -> (0, D) (torch's max and
    padding_idx kernels crash on entries without offsets); a (B, 0) input gives (B, D)
    zeros (torch 2.13 fails inside its own ``arange`` there).  With
    ``include_last_offset=True`` the last offset must be ``len(input)``: torch's kernels
    disagree about entries after it (pytorch#52851), so seqlib raises a ValueError.
    """
    check_weight(weight)
    check_bag_mode(mode, sparse, scale_grad_by_freq)
    num_embeddings, embedding_dim = weight.shape
    path = path_for(weight.dtype)
    indices, outside, offsets, include_last_offset, bounds, broken, flat_weights, padding_idx = _bag_arguments(
        input, num_embeddings, weight.dtype, offsets, mode, per_sample_weights, include_last_offset, padding_idx, path
    )
    check_max_norm(max_norm, norm_type)
    if weight.size == 0:  # V or D is 0: empty bags or no columns (and MLX cannot scatter a gradient into it)
        return mx.zeros((bounds.size - 1, embedding_dim), weight.dtype)
    if max_norm is not None:
        weight = renorm_for_lookup(weight, indices, max_norm, norm_type)
    if _native_serves(weight, indices) and not scale_grad_by_freq:
        return _native_pool(weight, indices.astype(mx.int32), bounds, mode, flat_weights, padding_idx)
    grad_scale = _inverse_frequency(indices, num_embeddings) if scale_grad_by_freq else None
    on_host = outside is None and broken is None and all(host_values(a) is not None for a in (indices, offsets))
    if path == "plain" or not on_host:
        return _pool_in_graph(weight, indices, bounds, mode, flat_weights, padding_idx, grad_scale, outside, broken)
    if path == "kernels" and not scale_grad_by_freq:
        return bag_kernels.pool_bags(weight, indices.astype(mx.int32), np.asarray(bounds), mode, flat_weights,
                                     padding_idx)  # checked above  # fmt: skip
    return _pool_on_host_layout(weight, indices, offsets, include_last_offset, mode, flat_weights, padding_idx,
                                grad_scale)  # fmt: skip


def _bag_arguments(input, num_embeddings, dtype, offsets, mode, per_sample_weights, include_last_offset, padding_idx,
                   path):  # fmt: skip
    """embedding_bag's input, offsets, weights and padding_idx checked, as one flat (N,) input with offsets
    (:func:`seqlib._bags.flatten_bags`); the indices safe to read and the bounds valid (see
    :func:`_checked_indices`, :func:`_checked_bounds`)."""
    check_per_sample_weights(per_sample_weights, mode, as_index_array(input, "input").shape, dtype)
    indices, offsets, flat_weights, include_last_offset = flatten_bags(
        input, offsets, per_sample_weights, include_last_offset
    )
    bounds = _host_bag_bounds(indices, offsets, num_embeddings, include_last_offset)
    outside = broken = None
    if bounds is None:
        indices, outside = _checked_indices(indices, num_embeddings, path)
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    if bounds is None:
        bounds, broken = _checked_bounds(offsets, indices.size, include_last_offset, path)
    return indices, outside, offsets, include_last_offset, bounds, broken, flat_weights, padding_idx


def _host_bag_bounds(indices, offsets, num_embeddings: int, include_last_offset: bool) -> mx.array | None:
    """The bounds (B + 1,) int32 where seqlib.native checked ``indices`` and ``offsets`` on the host in one pass
    and they passed; else None (not built here, NumPy or lazy arrays, or a check failed): then
    :func:`_checked_indices` and :func:`_checked_bounds` check them, with their messages."""
    extension = native.module()
    if extension is None or not isinstance(indices, mx.array) or not isinstance(offsets, mx.array):
        return None
    return extension.host_bag_bounds(indices, offsets, num_embeddings, include_last_offset)


def _dequantized_rows(indices, weight, scales, biases, group_size, bits, mode) -> mx.array:
    """The rows ``indices`` (*) of a table quantized by ``mx.quantize``, dequantized: (*, D)."""
    return mx.dequantize(weight[indices], scales=scales[indices], biases=None if biases is None else biases[indices],
                         group_size=group_size, bits=bits, mode=mode)  # fmt: skip


def quantized_embedding(input, weight, scales, biases=None, group_size: int = 64, bits: int = 4,
                        mode: str = "affine") -> mx.array:  # fmt: skip
    """:func:`embedding` of a table quantized by ``mx.quantize``: ``(*) -> (*, D)``, the rows dequantized.

    ``weight``, ``scales``, ``biases`` are ``mx.quantize(table, group_size, bits, mode=mode)``'s outputs
    for a (V, D) table (V rows); ``input`` is checked as :func:`embedding` checks it.  For inference: a
    quantized table has no gradient (``mlx.nn.QuantizedEmbedding`` computes the same, unchecked).
    """
    indices, outside = _checked_indices(as_index_array(input, "input"), weight.shape[0], path_for(scales.dtype))
    return _with_nan_rows(_dequantized_rows(indices, weight, scales, biases, group_size, bits, mode), outside)


def quantized_embedding_bag(input, weight, scales, biases=None, group_size: int = 64, bits: int = 4,
                            quantization_mode: str = "affine", offsets=None, mode: str = "mean",
                            per_sample_weights=None, include_last_offset: bool = False,
                            padding_idx: int | None = None) -> mx.array:  # fmt: skip
    """:func:`embedding_bag` of a table quantized by ``mx.quantize``: (B, D), from each entry's dequantized row.

    ``weight``, ``scales``, ``biases`` as in :func:`quantized_embedding` (``quantization_mode`` is
    ``mx.quantize``'s mode); the bag arguments as in :func:`embedding_bag`, with their checks.  The rows
    are dequantized, (N, D), and pooled by :func:`pool_rows`.  For inference.
    """
    check_bag_mode(mode, False, False)
    indices, outside, _, _, bounds, broken, flat_weights, padding_idx = _bag_arguments(
        input, weight.shape[0], scales.dtype, offsets, mode, per_sample_weights, include_last_offset, padding_idx,
        path_for(scales.dtype),
    )  # fmt: skip
    rows = _with_nan_rows(_dequantized_rows(indices, weight, scales, biases, group_size, bits, quantization_mode),
                          outside)  # fmt: skip
    counted = None if padding_idx is None else indices != padding_idx
    return pool_rows(rows, bounds, mode, flat_weights, counted, broken)


def _pool_in_graph(weight, indices, bounds, mode, flat_weights, padding_idx, grad_scale, outside, broken):
    """Bags pooled by scatters over each entry's bag, for indices and offsets known only in the graph (and
    on the ``"plain"`` path): nothing depends on their values at the call.  (B, D)."""
    rows = _with_nan_rows(mx.take(weight, indices, axis=0), outside)  # (N, D)
    if grad_scale is not None:
        rows = _scaled_gradient(rows, grad_scale[:, None])
    counted = None if padding_idx is None else indices != padding_idx
    return pool_rows(rows, bounds, mode, flat_weights, counted, broken)


def pool_rows(rows: mx.array, bounds: mx.array, mode: str = "mean", per_sample_weights: mx.array | None = None,
              counted: mx.array | None = None, broken: mx.array | None = None) -> mx.array:  # fmt: skip
    """Pool rows already looked up, (N, D), into the bags ``bounds`` (B + 1,) int32 give: (B, D).

    The pooling of :func:`embedding_bag` for rows from anywhere (a quantized table's dequantized
    rows): each entry's bag is the number of bag starts at or before it (a cumulative sum), and the
    pooling is one scatter-add into the bags, for ``max`` of each column's winning entry alone
    (the first of equal values, as torch's), so that its gradient goes to that entry only.  A NaN
    loses in ``max`` here (torch's CPU rule keeps a NaN in first place).  ``counted`` (N,) bool:
    the entries that count (False for padding), None for all; ``broken``: a scalar that turns every
    bag to NaN where True (offsets that broke torch's rules, found in the graph).  ``bounds`` must
    be valid: non-decreasing from 0 to N.
    """
    num_bags, (count, dim), dtype = bounds.size - 1, rows.shape, rows.dtype
    if num_bags == 0:
        return mx.zeros((0, dim), dtype)
    bag = mx.cumsum(mx.zeros((count + 1,), mx.int32).at[bounds[1:-1]].add(1))[:count]  # (N,) each entry's bag
    counted = mx.ones((count,), mx.bool_) if counted is None else counted
    if mode == "max":
        pooled = mx.zeros((num_bags, dim), dtype).at[bag].add(_first_maxima(rows, counted, bag, num_bags))
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[:, None].astype(dtype)
        pooled = mx.zeros((num_bags, dim), dtype).at[bag].add(mx.where(counted[:, None], rows, 0))
        if mode == "mean":
            sizes = mx.zeros((num_bags,), mx.float32).at[bag].add(counted.astype(mx.float32))
            pooled = pooled / mx.maximum(sizes, 1).astype(dtype)[:, None]
    return pooled if broken is None else mx.where(broken, mx.array(float("nan"), dtype), pooled)


def _first_maxima(rows: mx.array, counted: mx.array, bag: mx.array, num_bags: int) -> mx.array:
    """``rows`` (N, D) where an entry holds its bag's maximum of a column and is the first to hold it,
    else 0: torch's winners (the first of equal values), found with scatters and no gradient."""
    count, dtype = rows.shape[0], rows.dtype
    candidates = mx.stop_gradient(mx.where(counted[:, None], rows, mx.array(-float("inf"), dtype)))
    best = mx.full((num_bags, rows.shape[1]), -float("inf"), dtype).at[bag].maximum(candidates)
    position = mx.where(candidates == best[bag], mx.arange(count)[:, None], count)  # (N, D): ties keep theirs
    first = mx.full((num_bags, rows.shape[1]), count, position.dtype).at[bag].minimum(position)
    wins = counted[:, None] & (position == first[bag])
    return mx.where(wins, rows, mx.array(0, dtype))


def _pool_on_host_layout(weight, indices, offsets, include_last_offset, mode, flat_weights, padding_idx, grad_scale):
    """Bags pooled from a layout worked out on the host (:func:`seqlib._bags.bag_layout`): one gather of the
    counted entries, bucket by bucket, and one reduction per bucket of equally long bags.  (B, D)."""
    embedding_dim = weight.shape[1]
    layout = bag_layout(indices, offsets, include_last_offset, padding_idx)
    entries = mx.array(layout.entry_order.astype(np.int32))  # (N',) counted entries, bucket by bucket
    rows = mx.take(weight, indices[entries], axis=0)  # (N', D): the only read of the table
    if grad_scale is not None:
        rows = _scaled_gradient(rows, grad_scale[entries][:, None])
    entry_weights = flat_weights[entries].astype(rows.dtype) if flat_weights is not None else None

    pooled = [_pool_buckets(rows, entry_weights, layout.bucket_shapes, mode)] if layout.bucket_shapes else []
    empty_bags = layout.num_bags - sum(bags for bags, _ in layout.bucket_shapes)
    if empty_bags:
        pooled.append(mx.zeros((empty_bags, embedding_dim), dtype=weight.dtype))
    if not pooled:
        return mx.zeros((0, embedding_dim), dtype=weight.dtype)
    # The buckets come out grouped by length; put the bags back in their own order.
    where_each_bag_is = mx.array(np.argsort(layout.bag_order).astype(np.int32))
    return mx.take(mx.concatenate(pooled, axis=0), where_each_bag_is, axis=0).astype(weight.dtype)
