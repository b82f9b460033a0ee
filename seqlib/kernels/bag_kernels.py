"""The bag kernels: ``embedding_bag`` (sum, mean or max of bags of rows, fused with the gather) and its gradients.

Reference: :func:`seqlib.reference.embedding_bag` and
:func:`seqlib.reference.embedding_bag_backward` compute the same in NumPy.

Bags reach the kernels as ``bag_bounds`` (B + 1,): bag b holds entries
``bag_bounds[b]:bag_bounds[b + 1]`` (torch's offsets with the end appended).
:func:`embedding_bag` checks its arguments; :func:`pool_bags` is the launch for
callers (:mod:`seqlib.functional`) that have run the same checks already.
"""

from __future__ import annotations

import enum

import mlx.core as mx
import numpy as np

from seqlib._bags import BAG_MODES, bag_bounds, flatten_bags
from seqlib._checks import as_index_array, check_choice, check_per_sample_weights, normalize_padding_idx
from seqlib.kernels.runtime import T, KernelSpec, build_kernel, elementwise_launch
from seqlib.kernels.embedding_kernels import check_kernel_table, checked_indices, padding_scalar

__all__ = ["BagMode", "embedding_bag", "pool_bags"]


class BagMode(enum.IntEnum):
    """The bag kernels' MODE template argument (``MODE_*`` in seqlib_math.h), one per name in ``BAG_MODES``."""

    SUM = 0
    MEAN = 1
    MAX = 2


_BAG_TEMPLATE = (("T", T), ("MODE", 0), ("WEIGHTED", False))
EMBEDDING_BAG = KernelSpec(
    "embedding_bag",
    (("weight", T), ("indices", mx.int32), ("bag_bounds", mx.int32), ("per_sample_weights", T),
     ("padding_idx", mx.int32)),
    (("out", T), ("max_entry", mx.int32)),
    template=_BAG_TEMPLATE,
    scalars=("padding_idx",),
)  # fmt: skip
EMBEDDING_BAG_BACKWARD = KernelSpec(
    "embedding_bag_backward",
    (("d_out", T), ("indices", mx.int32), ("bag_of_entry", mx.int32), ("bag_size", mx.int32),
     ("per_sample_weights", T), ("max_entry", mx.int32), ("padding_idx", mx.int32)),
    (("d_weight", mx.float32),),
    template=_BAG_TEMPLATE,
    scalars=("padding_idx",),
    atomic=True,
)  # fmt: skip
EMBEDDING_BAG_PER_SAMPLE_WEIGHTS_BACKWARD = KernelSpec(
    "embedding_bag_per_sample_weights_backward",
    (("d_out", T), ("weight", T), ("indices", mx.int32), ("bag_of_entry", mx.int32), ("padding_idx", mx.int32)),
    (("d_per_sample_weights", T),),
    scalars=("padding_idx",),
)
SPECS = (EMBEDDING_BAG, EMBEDDING_BAG_BACKWARD, EMBEDDING_BAG_PER_SAMPLE_WEIGHTS_BACKWARD)


def embedding_bag(
    input,
    weight: mx.array,
    offsets=None,
    mode: str = "mean",
    per_sample_weights: mx.array | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> mx.array:
    """Differentiable bags through embedding_bag.metal; gradients by the backward kernels.

    Arguments as :func:`seqlib.functional.embedding_bag`'s (without renormalisation or
    gradient scaling): a 1-D ``input`` with ``offsets`` (where each bag starts; with
    ``include_last_offset`` the last offset ends the last bag), or a 2-D ``input`` (B, L)
    of fixed-length bags; weight (V, D); ``per_sample_weights`` in mode "sum" only.
    Returns (B, D).  ``mx.grad`` reaches ``weight`` (embedding_bag_backward.metal) and
    ``per_sample_weights`` (embedding_bag_per_sample_weights_backward.metal).
    """
    check_kernel_table(weight)
    check_choice("mode", mode, BAG_MODES)
    check_per_sample_weights(per_sample_weights, mode, as_index_array(input, "input").shape, weight.dtype)
    indices, offsets, flat_weights, include_last_offset = flatten_bags(
        input, offsets, per_sample_weights, include_last_offset
    )
    num_embeddings = weight.shape[0]
    flat = checked_indices("input", indices, num_embeddings)
    bounds = bag_bounds(offsets, flat.size, include_last_offset)
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    return pool_bags(weight, flat, bounds, mode, flat_weights, padding_idx)


def _bag_membership(flat: mx.array, bounds: np.ndarray, padding_idx):
    """Each entry's bag (N,) and each bag's counted size (B,; padding entries do not count), as int32 arrays."""
    bag_of_entry = np.repeat(np.arange(bounds.size - 1, dtype=np.int32), np.diff(bounds))
    counted = np.ones(flat.size, bool) if padding_idx is None else np.asarray(flat) != padding_idx
    bag_size = np.bincount(bag_of_entry[counted], minlength=bounds.size - 1).astype(np.int32)
    return mx.array(bag_of_entry), mx.array(bag_size)


def pool_bags(weight, flat, bounds: np.ndarray, mode: str, per_sample_weights, padding_idx) -> mx.array:
    """:func:`embedding_bag` for checked arguments: flat (N,) int32 indices in range, bounds (B + 1,) NumPy
    ending at N, per_sample_weights (N,) or None, padding_idx in [0, V) or None."""
    num_bags, embedding_dim = bounds.size - 1, weight.shape[1]
    if flat.size == 0 or num_bags == 0 or embedding_dim == 0:  # nothing to launch: empty bags give zeros
        return mx.zeros((num_bags, embedding_dim), weight.dtype)
    bag_of_entry, bag_size = _bag_membership(flat, bounds, padding_idx)
    bounds = mx.array(bounds.astype(np.int32))
    weighted = per_sample_weights is not None
    template = [("MODE", int(BagMode[mode.upper()])), ("WEIGHTED", weighted)]
    padding = padding_scalar(padding_idx)

    @mx.custom_function
    def bag(table, sample_weights):
        kernel = build_kernel(EMBEDDING_BAG)
        return tuple(
            kernel(
                inputs=[table, flat, bounds, sample_weights, padding],
                template=[("T", table.dtype), *template],
                output_shapes=[(num_bags, embedding_dim), (num_bags, embedding_dim)],
                output_dtypes=[table.dtype, mx.int32],
                **elementwise_launch(num_bags, embedding_dim),
            )
        )

    @bag.vjp
    def bag_vjp(primals, cotangents, outputs):
        table, sample_weights = primals
        d_out, max_entry = cotangents[0], outputs[1]
        backward = build_kernel(EMBEDDING_BAG_BACKWARD)
        items = num_bags if mode == "max" else flat.size  # max: one thread per bag column, else per entry column
        d_weight = backward(
            inputs=[d_out, flat, bag_of_entry, bag_size, sample_weights, max_entry, padding],
            template=[("T", d_out.dtype), *template],
            output_shapes=[table.shape],
            output_dtypes=[mx.float32],
            init_value=0,
            **elementwise_launch(items, embedding_dim),
        )[0].astype(table.dtype)
        if not weighted:
            return d_weight, mx.zeros_like(sample_weights)
        weights_kernel = build_kernel(EMBEDDING_BAG_PER_SAMPLE_WEIGHTS_BACKWARD)
        d_sample_weights = weights_kernel(
            inputs=[d_out, table, flat, bag_of_entry, padding],
            template=[("T", sample_weights.dtype)],
            output_shapes=[(flat.size,)],
            output_dtypes=[sample_weights.dtype],
            grid=(32, flat.size, 1),
            threadgroup=(32, 8, 1),
        )[0]
        return d_weight, d_sample_weights

    sample_weights = per_sample_weights if weighted else mx.ones((1,), weight.dtype)
    return bag(weight, sample_weights)[0]
