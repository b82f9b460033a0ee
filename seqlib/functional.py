"""Functional forms of seqlib's layers, with PyTorch's signatures.

Like ``torch.nn.functional``, these take the weights as arguments and hold no
state.  The modules in :mod:`seqlib.nn` call them.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from seqlib._checks import (
    as_index_array,
    check_index_range,
    check_max_norm,
    check_weight,
    normalize_padding_idx,
)

__all__ = ["embedding", "embedding_renorm", "renorm_for_lookup"]


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
    unique_rows = mx.array(np.unique(np.array(indices.reshape(-1), copy=False)).astype(np.int32))
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


def embedding(
    input: mx.array,
    weight: mx.array,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
) -> mx.array:
    """Look up rows of ``weight`` (V, D) for integer ``input`` of any shape: (*) -> (*, D).

    - ``padding_idx``: lookups of that row return its values but send it no gradient.
    - ``max_norm``: looked-up rows are first renormalised as by :func:`embedding_renorm`.
      torch does this to ``weight`` in place; MLX arrays are immutable, so here the
      lookup reads a renormalised copy and the gradient flows to ``weight`` as if the
      renormalisation were the identity (as in torch, where it runs under ``no_grad``).
      :class:`seqlib.nn.Embedding` stores the renormalised copy as its new weight.
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
    if padding_idx is not None:
        is_padding = mx.expand_dims(indices == padding_idx, -1)
        rows = mx.where(is_padding, mx.stop_gradient(rows), rows)
    return rows
