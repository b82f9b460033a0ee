"""Functional forms of seqlib's layers, with PyTorch's signatures.

Like ``torch.nn.functional``, these take the weights as arguments and hold no
state.  The modules in :mod:`seqlib.nn` call them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from seqlib._bags import bag_layout, flatten_bags
from seqlib._checks import (
    as_index_array,
    check_index_range,
    check_max_norm,
    check_weight,
    normalize_padding_idx,
)

__all__ = ["embedding", "embedding_bag", "embedding_renorm", "renorm_for_lookup"]

BAG_MODES = ("sum", "mean", "max")


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
    """
    check_weight(weight)
    check_max_norm(max_norm, norm_type)
    indices = as_index_array(input, "input")
    check_index_range(indices, weight.shape[0], "input")
    unique_rows = mx.array(np.unique(np.asarray(indices).reshape(-1)).astype(np.int32))
    if unique_rows.size == 0:
        return weight
    norms = _row_norms(weight[unique_rows], norm_type)  # (n,)
    scale = mx.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
    return weight.at[unique_rows].multiply(scale[:, None].astype(weight.dtype))


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
    renormed = embedding_renorm(weight, input, max_norm, norm_type)
    return _straight_through(weight, mx.stop_gradient(renormed))


@mx.custom_function
def _scale_gradient(x: mx.array, scale: mx.array) -> mx.array:
    """Forward: ``x`` unchanged.  Backward: the gradient times ``scale`` (broadcast to x)."""
    return x


@_scale_gradient.vjp
def _scale_gradient_vjp(primals, cotangent, output):
    _, scale = primals
    return (cotangent * scale).astype(cotangent.dtype), mx.zeros_like(scale)


def _inverse_frequency(indices: mx.array) -> mx.array:
    """For each index, 1 / (how often it occurs in ``indices``): torch's ``scale_grad_by_freq``."""
    flat = np.asarray(indices).reshape(-1)
    _, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
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
    """Look up rows of ``weight`` (V, D) for integer ``input`` of any shape: (*) -> (*, D).

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
    """
    check_weight(weight)
    indices = as_index_array(input, "input")
    num_embeddings = weight.shape[0]
    check_index_range(indices, num_embeddings, "input")
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    check_max_norm(max_norm, norm_type)

    if max_norm is not None:
        weight = renorm_for_lookup(weight, indices, max_norm, norm_type)
    rows = mx.take(weight, indices, axis=0)  # (*, D)
    if padding_idx is None and not scale_grad_by_freq:
        return rows
    grad_scale = mx.ones(indices.shape, dtype=mx.float32)
    if scale_grad_by_freq:
        grad_scale = _inverse_frequency(indices)
    if padding_idx is not None:
        grad_scale = mx.where(indices == padding_idx, 0.0, grad_scale)
    return _scale_gradient(rows, mx.expand_dims(grad_scale, -1))


def _check_mode(mode: str, sparse: bool, scale_grad_by_freq: bool) -> None:
    if mode not in BAG_MODES:
        raise ValueError(f"mode: expected one of {BAG_MODES}, got {mode!r}")
    if mode == "max" and sparse:
        raise ValueError("sparse: mode='max' has no sparse gradient (as in torch); use sparse=False or another mode")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError("scale_grad_by_freq: not supported with mode='max' (as in torch)")


def _check_per_sample_weights(per_sample_weights, indices: mx.array, mode: str, dtype) -> None:
    if per_sample_weights is None:
        return
    if mode != "sum":
        raise ValueError(f"per_sample_weights: only supported with mode='sum', got mode={mode!r}")
    if not isinstance(per_sample_weights, mx.array):
        raise TypeError(f"per_sample_weights: expected an mlx.core.array, got {type(per_sample_weights).__name__}")
    if not mx.issubdtype(per_sample_weights.dtype, mx.floating):
        raise TypeError(f"per_sample_weights: expected a floating dtype, got {per_sample_weights.dtype}")
    if tuple(per_sample_weights.shape) != tuple(indices.shape):
        raise ValueError(
            f"per_sample_weights: expected the shape of input {tuple(indices.shape)}, "
            f"got {tuple(per_sample_weights.shape)}"
        )


def _reduce_bucket(rows: mx.array, weights: mx.array | None, mode: str) -> mx.array:
    """Reduce (n, length, D) rows of n equally long bags to (n, D)."""
    if mode == "max":
        # take_along_axis of the arg-max (its first occurrence, like torch) sends the
        # gradient to that one entry only.
        winner = mx.stop_gradient(mx.argmax(rows, axis=1, keepdims=True))  # (n, 1, D)
        return mx.take_along_axis(rows, winner, axis=1).squeeze(1)
    if weights is not None:
        rows = rows * weights[..., None]
    total = mx.sum(rows, axis=1)
    return total / rows.shape[1] if mode == "mean" else total


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
    bag gives zeros in every mode.  ``per_sample_weights`` (the shape of ``input``)
    weight each entry, in ``mode="sum"`` only.  Returns (B, D).
    """
    check_weight(weight)
    _check_mode(mode, sparse, scale_grad_by_freq)
    indices, offsets, flat_weights, include_last_offset = flatten_bags(
        input, offsets, per_sample_weights, include_last_offset
    )
    num_embeddings, embedding_dim = weight.shape
    check_index_range(indices, num_embeddings, "input")
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    check_max_norm(max_norm, norm_type)
    _check_per_sample_weights(flat_weights, indices, mode, weight.dtype)
    layout = bag_layout(indices, offsets, include_last_offset, padding_idx)

    if max_norm is not None:
        weight = renorm_for_lookup(weight, indices, max_norm, norm_type)
    grad_scale = _inverse_frequency(indices)[:, None] if scale_grad_by_freq else None

    pooled, order = [], []
    for bucket in layout.buckets:
        positions = mx.array(bucket.positions.astype(np.int32))  # (n, length)
        rows = mx.take(weight, indices[positions], axis=0)  # (n, length, D)
        if grad_scale is not None:
            rows = _scale_gradient(rows, grad_scale[positions])
        bucket_weights = flat_weights[positions] if flat_weights is not None else None
        pooled.append(_reduce_bucket(rows, bucket_weights, mode))
        order.append(bucket.bags)
    empty_bags = np.flatnonzero(layout.counts == 0)
    if empty_bags.size:
        pooled.append(mx.zeros((empty_bags.size, embedding_dim), dtype=weight.dtype))
        order.append(empty_bags)
    if not pooled:
        return mx.zeros((0, embedding_dim), dtype=weight.dtype)
    # Buckets come out grouped by length; put the bags back in their own order.
    where_each_bag_is = np.argsort(np.concatenate(order)).astype(np.int32)
    return mx.take(mx.concatenate(pooled, axis=0), mx.array(where_each_bag_is), axis=0).astype(weight.dtype)
