"""The lookup kernels: ``embedding_gather`` with its gradient ``embedding_backward``, and ``embedding_renorm``.

Reference: :func:`seqlib.reference.embedding`, :func:`seqlib.reference.embedding_backward`
and :func:`seqlib.reference.embedding_renorm` compute the same in NumPy.

:func:`embedding` and :func:`embedding_renorm_scales` check their arguments;
:func:`gather_rows` and :func:`renorm_scales` are the launches themselves, for
callers (:mod:`seqlib.functional`) that have run the same checks already, so an
index range (an evaluation) is never checked twice on the way to a kernel.
"""

from __future__ import annotations

import enum

import mlx.core as mx
import numpy as np

from seqlib._checks import (
    as_index_array,
    check_float_array,
    check_index_range,
    check_max_norm,
    check_weight,
    normalize_padding_idx,
)
from seqlib.kernels.runtime import T, KernelSpec, build_kernel, check_kernel_dtype, elementwise_launch, int_scalar

__all__ = ["NormKind", "embedding", "embedding_renorm_scales", "gather_rows", "renorm_scales"]


EMBEDDING_GATHER = KernelSpec("embedding_gather", (("weight", T), ("indices", mx.int32)), (("out", T),), template=())
EMBEDDING_BACKWARD = KernelSpec(
    "embedding_backward",
    (("d_out", T), ("indices", mx.int32), ("grad_scale", mx.float32), ("padding_idx", mx.int32)),
    (("d_weight", mx.float32),),
    template=(("T", T), ("SCALED", False)),
    scalars=("padding_idx",),
    atomic=True,
)
EMBEDDING_RENORM = KernelSpec(
    "embedding_renorm",
    (("weight", T), ("rows", mx.int32), ("max_norm", mx.float32), ("norm_type", mx.float32)),
    (("scale", mx.float32),),
    template=(("T", T), ("NORM", 2)),
    scalars=("max_norm", "norm_type"),
)
SPECS = (EMBEDDING_GATHER, EMBEDDING_BACKWARD, EMBEDDING_RENORM)


class NormKind(enum.IntEnum):
    """embedding_renorm.metal's NORM template argument (``NORM_*`` in seqlib_math.h)."""

    MAX = 0  # p = inf
    L1 = 1
    L2 = 2
    P = 3  # any other p > 0, through pow


def norm_kind(norm_type: float) -> NormKind:
    """The kernel's code for a ``norm_type`` already checked to be > 0."""
    if np.isinf(norm_type):
        return NormKind.MAX
    return {1.0: NormKind.L1, 2.0: NormKind.L2}.get(float(norm_type), NormKind.P)


def check_kernel_table(weight) -> None:
    """``weight`` must be a (V, D) array of a dtype the kernels take."""
    check_weight(weight)
    check_kernel_dtype("weight", weight)


def checked_indices(name: str, indices, num_embeddings: int) -> mx.array:
    """``indices`` (integers in [0, num_embeddings), any shape) as int32, after checking."""
    indices = as_index_array(indices, name)
    check_index_range(indices, num_embeddings, name)
    return indices.astype(mx.int32)


def padding_scalar(padding_idx: int | None) -> mx.array:
    """The kernels' ``padding_idx`` input: the row, or -1 for none."""
    return int_scalar(-1 if padding_idx is None else int(padding_idx))


def embedding(input, weight: mx.array, padding_idx: int | None = None, grad_scale=None) -> mx.array:
    """Differentiable lookup ``weight[input]`` through embedding_gather.metal; gradient by embedding_backward.metal.

    input: integers in [0, V) of any shape; weight (V, D); padding_idx: a row in
    [-V, V) (negative counts from the end, as in torch) that gets no gradient, or None;
    grad_scale: (input.size,) float factor per lookup, or None.  Returns ``(*input.shape, D)``.
    The gradient is the scatter-add ``d_weight[input[n]] += grad_scale[n] * d_out[n]``.
    """
    check_kernel_table(weight)
    num_embeddings = weight.shape[0]
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    indices = checked_indices("input", input, num_embeddings)
    if grad_scale is not None:
        check_float_array(grad_scale, "grad_scale", (indices.size,))
    return gather_rows(weight, indices, padding_idx, grad_scale)


def _scatter_rows(d_out, flat_indices, num_embeddings, padding_idx, grad_scale) -> mx.array:
    """embedding_backward.metal: scatter-add of (N, D) row gradients into a (V, D) float32 table."""
    num_lookups, embedding_dim = d_out.shape
    scaled = grad_scale is not None
    kernel = build_kernel(EMBEDDING_BACKWARD)
    return kernel(
        inputs=[d_out, flat_indices, grad_scale if scaled else mx.ones((1,)), padding_scalar(padding_idx)],
        template=[("T", d_out.dtype), ("SCALED", scaled)],
        output_shapes=[(num_embeddings, embedding_dim)],
        output_dtypes=[mx.float32],
        init_value=0,
        **elementwise_launch(num_lookups, embedding_dim),
    )[0]


def gather_rows(weight: mx.array, indices: mx.array, padding_idx: int | None, grad_scale) -> mx.array:
    """:func:`embedding` for checked arguments: indices int32 in range, padding_idx in [0, V) or None."""
    num_embeddings, embedding_dim = weight.shape
    shape = tuple(indices.shape)
    flat = indices.reshape(-1).astype(mx.int32)
    if flat.size == 0 or embedding_dim == 0:  # nothing to launch (torch: an empty result too)
        return mx.zeros((*shape, embedding_dim), weight.dtype)
    gather = build_kernel(EMBEDDING_GATHER)

    @mx.custom_function
    def lookup(table):
        return gather(
            inputs=[table, flat],
            output_shapes=[(flat.size, embedding_dim)],
            output_dtypes=[table.dtype],
            **elementwise_launch(flat.size, embedding_dim),
        )[0]

    @lookup.vjp
    def lookup_vjp(table, cotangent, output):
        d_weight = _scatter_rows(cotangent, flat, num_embeddings, padding_idx, grad_scale)
        return d_weight.astype(table.dtype)

    return lookup(weight).reshape(*shape, embedding_dim)


def embedding_renorm_scales(weight: mx.array, rows, max_norm: float, norm_type: float = 2.0) -> mx.array:
    """embedding_renorm.metal: for each of ``rows`` (U,) the factor that brings it inside ``max_norm``.

    Returns (U,) float32: ``max_norm / (norm + 1e-7)`` where the row's ``norm_type``-norm
    exceeds ``max_norm``, else 1.  ``max_norm`` >= 0, ``norm_type`` > 0 (inf allowed).
    """
    check_kernel_table(weight)
    flat_rows = checked_indices("rows", rows, weight.shape[0]).reshape(-1)
    check_max_norm(max_norm, norm_type, required=True)
    return renorm_scales(weight, flat_rows, max_norm, norm_type)


def renorm_scales(weight, flat_rows, max_norm, norm_type) -> mx.array:
    """:func:`embedding_renorm_scales` for checked arguments: flat_rows (U,) int32 in range."""
    embedding_dim = weight.shape[1]
    if flat_rows.size == 0 or embedding_dim == 0:  # an empty row has norm 0: never rescaled
        return mx.ones((flat_rows.size,), mx.float32)
    kind = norm_kind(norm_type)
    threads = min(1024, -(-embedding_dim // 32) * 32)
    p = float(norm_type) if kind == NormKind.P else 2.0  # read by the kernel only for NormKind.P
    kernel = build_kernel(EMBEDDING_RENORM)
    return kernel(
        inputs=[weight, flat_rows, mx.array(float(max_norm)), mx.array(p)],
        template=[("T", weight.dtype), ("NORM", int(kind))],
        output_shapes=[(flat_rows.size,)],
        output_dtypes=[mx.float32],
        grid=(threads, flat_rows.size, 1),
        threadgroup=(threads, 1, 1),
    )[0]
