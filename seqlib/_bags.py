"""How the indices of an EmbeddingBag call fall into bags, worked out once in NumPy.

``embedding_bag`` takes its bags either as a 2-D ``(B, N)`` input (B bags of N
indices each) or as a flat 1-D input plus ``offsets`` (the CSR form: bag ``b``
holds ``input[offsets[b]:offsets[b + 1]]``).  :func:`bag_layout` checks both
forms and sorts the bags into *buckets*: groups of bags with the same number of
entries that count (padding left out).  Listing the entries bucket by bucket
(``entry_order``) lets ``embedding_bag`` gather every row it needs with one
``take``, split the result into one ``(bags, length, D)`` block per bucket and
reduce each block over its middle axis: a handful of array operations, none
wasted on padding to the longest bag, and a backward pass that scatters into
the table once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from seqlib._checks import as_index_array, host_index_array
from seqlib.graph import host_values


BAG_MODES = ("sum", "mean", "max")  # how a bag's rows are pooled (the kernels' BagMode, in this order)


@dataclass(frozen=True)
class BagLayout:
    num_bags: int
    entry_order: np.ndarray  # (N',) positions into the flat input: bucket by bucket, bag by bag
    bucket_shapes: list[tuple[int, int]]  # (bags, entries per bag) of each bucket, in that order
    bag_order: np.ndarray  # (B,) the bags in the order they come out: bucket by bucket, then empty bags


def checked_offsets(offsets, input_size: int, allow_empty: bool = False) -> np.ndarray:
    """``offsets`` as NumPy (an integer dtype, NumPy's as given), after checking torch's rules (1-D, starts at 0,
    non-decreasing, within input).  Few NumPy calls: a bag's forward makes them on every call."""
    offsets = host_index_array(offsets, "offsets")
    if offsets.ndim != 1:
        raise ValueError(f"offsets: expected a 1-D array, got shape {offsets.shape}")
    if offsets.size == 0:
        if allow_empty:
            return offsets
        raise ValueError("offsets: expected at least one element, got an empty array")
    if offsets[0] != 0:
        raise ValueError(f"offsets: the first bag must start at 0, got offsets[0] = {offsets[0]}")
    decreasing = offsets[1:] < offsets[:-1]  # compared, not subtracted: an unsigned difference would wrap
    if decreasing.any():
        where = int(np.argmax(decreasing))
        raise ValueError(
            f"offsets: must be non-decreasing, got offsets[{where}] = {offsets[where]} "
            f"> offsets[{where + 1}] = {offsets[where + 1]}"
        )
    if offsets[-1] > input_size:  # the largest, as they do not decrease from 0
        raise ValueError(
            f"offsets: may not point past the end of input (length {input_size}), got offsets[-1] = {offsets[-1]}"
        )
    return offsets


def bag_bounds(offsets, input_size: int, include_last_offset: bool, dtype=np.int64) -> np.ndarray:
    """The bags' bounds (B + 1,) as NumPy of ``dtype``: bag ``b`` holds entries ``bounds[b]:bounds[b + 1]``.

    Without ``include_last_offset`` the last bag runs to the end of input, and empty
    ``offsets`` mean no bags (as in torch).  With it, ``offsets`` are the bounds and must
    end at ``input_size``: torch disagrees with itself about entries after the last
    offset (its sum/mean kernels drop them, its max and padding_idx kernels put them
    in the last bag; pytorch#52851), so seqlib refuses them.  The values lie in [0, input_size] (checked), so any
    ``dtype`` that holds input_size holds them.
    """
    offsets = checked_offsets(offsets, input_size, allow_empty=not include_last_offset)
    if not include_last_offset:
        if offsets.size == 0:
            return np.zeros(1, dtype)
        bounds = np.empty(offsets.size + 1, dtype)
        bounds[:-1] = offsets
        bounds[-1] = input_size
        return bounds
    if offsets[-1] != input_size:
        raise ValueError(
            f"offsets: with include_last_offset=True the last offset must be the length of input ({input_size}), "
            f"got offsets[-1] = {offsets[-1]}; torch is inconsistent about the entries after it (pytorch#52851): "
            f"pass input[:{offsets[-1]}] to leave them out"
        )
    return offsets.astype(dtype)


def flatten_bags(input, offsets, per_sample_weights, include_last_offset: bool):
    """torch's two input forms -> (flat indices (N,), offsets, flat weights or None, include_last_offset).

    A 2-D input's rows are its bags, so ``include_last_offset`` does not apply to it (as in torch).
    ``per_sample_weights`` must already have been checked to have the input's shape.
    """
    indices = as_index_array(input, "input")
    if indices.ndim == 2:
        if offsets is not None:
            raise ValueError(
                f"offsets: must be None when input is 2-D (each row is one bag), got {type(offsets).__name__}"
            )
        num_bags, bag_size = indices.shape
        offsets = mx.array(np.arange(num_bags, dtype=np.int32) * bag_size)  # made from data: known on the host
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.reshape(-1)
        values = host_values(indices)  # a NumPy reshape keeps values known on the host known there
        indices = indices.reshape(-1) if values is None else mx.array(values.reshape(-1))
        include_last_offset = False
    elif indices.ndim == 1:
        if offsets is None:
            raise ValueError("offsets: required when input is 1-D (it says where each bag starts), got None")
    else:
        raise ValueError(f"input: expected a 1-D (with offsets) or 2-D array, got shape {tuple(indices.shape)}")
    return indices, offsets, per_sample_weights, include_last_offset


def bag_layout(indices: mx.array, offsets, include_last_offset: bool, padding_idx: int | None) -> BagLayout:
    """Check ``offsets`` against the flat ``indices`` and group the bags into buckets."""
    total = indices.size
    bounds = bag_bounds(offsets, total, include_last_offset)
    starts, ends = bounds[:-1], bounds[1:]
    num_bags = starts.size

    bag_of_entry = np.full(total, -1, dtype=np.int64)  # -1: in no bag (past the last offset)
    bag_of_entry[: bounds[-1]] = np.repeat(np.arange(num_bags), ends - starts)
    counted = bag_of_entry >= 0
    if padding_idx is not None:
        counted &= np.asarray(indices) != padding_idx
    counted_positions = np.flatnonzero(counted)
    counts = np.bincount(bag_of_entry[counted_positions], minlength=num_bags)
    first = np.cumsum(counts) - counts  # where each bag's counted entries start in counted_positions

    bags_in_order, positions, shapes = [], [], []
    for length in np.unique(counts[counts > 0]):
        bags = np.flatnonzero(counts == length)
        positions.append(counted_positions[first[bags][:, None] + np.arange(length)].reshape(-1))
        bags_in_order.append(bags)
        shapes.append((bags.size, int(length)))
    bags_in_order.append(np.flatnonzero(counts == 0))
    entry_order = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    return BagLayout(num_bags, entry_order, shapes, np.concatenate(bags_in_order))


def check_bag_mode(mode: str, sparse: bool, scale_grad_by_freq: bool) -> None:
    """Raise unless ``mode`` is one of BAG_MODES and allowed with ``sparse`` and ``scale_grad_by_freq``."""
    if mode not in BAG_MODES:
        raise ValueError(f"mode: expected one of {BAG_MODES}, got {mode!r}")
    if mode == "max" and sparse:
        raise ValueError("sparse: mode='max' has no sparse gradient (as in torch); use sparse=False or another mode")
    if mode == "max" and scale_grad_by_freq:
        raise ValueError("scale_grad_by_freq: not supported with mode='max' (as in torch)")
