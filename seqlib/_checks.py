"""Argument checks shared by seqlib's modules.

Every check runs when a function is *called* and raises a ValueError,
IndexError or TypeError that names the argument, what was expected and what
was given.  MLX itself does not bounds-check a gather (an index past the end
reads whatever memory lies there), so indices are checked here, before any
lookup or kernel runs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def as_index_array(value, name: str) -> mx.array:
    """Return ``value`` as an MLX integer array, or raise a TypeError."""
    if isinstance(value, np.ndarray):
        value = mx.array(value)
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array of integers, got {type(value).__name__}")
    if not mx.issubdtype(value.dtype, mx.integer):
        raise TypeError(f"{name}: expected an integer dtype (int32, int64, uint32, ...), got {value.dtype}")
    return value


def check_index_range(indices: mx.array, upper: int, name: str, what: str = "num_embeddings") -> None:
    """Raise an IndexError unless every element of ``indices`` lies in [0, upper)."""
    if indices.size == 0:
        return
    low, high = mx.min(indices), mx.max(indices)
    mx.eval(low, high)
    low, high = low.item(), high.item()
    if low < 0 or high >= upper:
        raise IndexError(
            f"{name}: every index must lie in [0, {upper}) ({what}={upper}); "
            f"got values from {low} to {high}"
        )


def check_positive_ints(**values) -> None:
    """Raise a ValueError naming the first of ``values`` that is not a positive int (bools excluded)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def normalize_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
    """Map a negative ``padding_idx`` to its row as torch does, after checking its range."""
    if padding_idx is None:
        return None
    if not isinstance(padding_idx, (int, np.integer)) or isinstance(padding_idx, bool):
        raise TypeError(f"padding_idx: expected an int or None, got {type(padding_idx).__name__}")
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(
            f"padding_idx: must lie in [-{num_embeddings}, {num_embeddings}) "
            f"(num_embeddings={num_embeddings}); got {padding_idx}"
        )
    return int(padding_idx) % num_embeddings


def check_max_norm(max_norm: float | None, norm_type: float) -> None:
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm: expected a positive number or None, got {max_norm!r}")
    if not isinstance(norm_type, (int, float)) or math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type: expected a positive number (inf allowed), got {norm_type!r}")


def check_weight(weight, name: str = "weight") -> None:
    if not isinstance(weight, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array, got {type(weight).__name__}")
    if weight.ndim != 2:
        raise ValueError(
            f"{name}: expected a 2-D (num_embeddings, embedding_dim) array, got shape {tuple(weight.shape)}"
        )
    if not mx.issubdtype(weight.dtype, mx.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {weight.dtype}")
