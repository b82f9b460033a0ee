"""Argument checks shared by seqlib's modules.

Every check runs when a function is *called* and raises a ValueError,
IndexError or TypeError that names the argument, what was expected and what
was given.  MLX itself does not bounds-check a gather (an index past the end
reads whatever memory lies there), so indices are checked here, before any
lookup or kernel runs.
"""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np


def as_index_array(value, name: str) -> mx.array:
    """Return ``value`` (an MLX or NumPy integer array) as an MLX array, or raise a TypeError.

    Floats are refused rather than truncated, bools rather than read as 0 and 1, and
    Python lists as in torch (build an array first).
    """
    if isinstance(value, np.ndarray):
        value = mx.array(host_index_array(value, name))
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array of integers, got {type(value).__name__}")
    if not mx.issubdtype(value.dtype, mx.integer):
        raise TypeError(f"{name}: expected an integer dtype (int32, int64, uint32, ...), got {value.dtype}")
    return value


def host_index_array(value, name: str) -> np.ndarray:
    """``value`` checked as :func:`as_index_array` checks it, as NumPy: a NumPy array as it is (no copy)."""
    if not isinstance(value, np.ndarray):
        return np.asarray(as_index_array(value, name))
    if not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer dtype (int32, int64, uint32, ...), got NumPy {value.dtype}")
    return value


def check_index_range(indices: mx.array | np.ndarray, upper: int, name: str, what: str = "num_embeddings") -> None:
    """Raise an IndexError unless every element of ``indices`` (MLX or NumPy) lies in [0, upper)."""
    if indices.size == 0:
        return
    if isinstance(indices, np.ndarray):  # already on the host: no round trip through MLX
        low, high = int(indices.min()), int(indices.max())
    else:
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


def check_nonnegative_ints(**values) -> None:
    """Raise unless each of ``values`` is an int >= 0 (torch allows empty tables, cells): TypeError or ValueError."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int >= 0, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value}")


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


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_max_norm(max_norm: float | None, norm_type: float, required: bool = False) -> None:
    """Check renormalisation's arguments: ``max_norm`` >= 0 (None allowed unless ``required``), ``norm_type`` > 0.

    torch accepts a negative ``max_norm`` (it flips the rows' signs) and ``norm_type`` <= 0
    (no norm); seqlib refuses both.  ``max_norm=0`` zeroes the rows looked up, as in torch.
    """
    if max_norm is None and required:
        raise TypeError("max_norm: expected a number >= 0, got None")
    if max_norm is not None and not _is_number(max_norm):
        raise TypeError(f"max_norm: expected a number >= 0 or None, got {type(max_norm).__name__} {max_norm!r}")
    if max_norm is not None and not max_norm >= 0:  # NaN fails too
        raise ValueError(f"max_norm: expected a number >= 0 or None, got {max_norm!r}")
    if not _is_number(norm_type):
        raise TypeError(f"norm_type: expected a positive number (inf allowed), got {type(norm_type).__name__}")
    if math.isnan(norm_type) or norm_type <= 0:
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


def check_per_sample_weights(per_sample_weights, mode: str, shape: tuple, dtype, of: str = "input") -> None:
    """Raise unless ``per_sample_weights`` is None or fits: mode "sum", ``shape`` (that of ``of``), ``dtype``.

    As torch: only ``mode="sum"`` weights its entries, and the weights must have the
    input's exact shape (a 2-D input's weights are 2-D too) and the table's dtype.
    """
    if per_sample_weights is None:
        return
    if mode != "sum":
        raise ValueError(f"per_sample_weights: only supported with mode='sum', got mode={mode!r}")
    if not isinstance(per_sample_weights, mx.array):
        raise TypeError(f"per_sample_weights: expected an mlx.core.array, got {type(per_sample_weights).__name__}")
    if per_sample_weights.dtype != dtype:
        raise TypeError(
            f"per_sample_weights: expected the dtype of weight ({dtype}), got {per_sample_weights.dtype}"
        )
    if tuple(per_sample_weights.shape) != tuple(shape):
        raise ValueError(
            f"per_sample_weights: expected the shape of {of} {tuple(shape)}, got {tuple(per_sample_weights.shape)}"
        )


def as_int_vector(value, name: str) -> np.ndarray:
    """``value`` (an MLX or NumPy integer array, or a list/tuple of ints) as a NumPy int64 array, or a TypeError.

    Floats are refused rather than truncated, bools rather than read as 0 and 1."""
    if isinstance(value, mx.array):
        if not mx.issubdtype(value.dtype, mx.integer):
            raise TypeError(f"{name}: expected an integer dtype (int32, int64, ...), got {value.dtype}")
        return np.array(value).astype(np.int64)
    if not isinstance(value, (np.ndarray, list, tuple)):
        raise TypeError(f"{name}: expected an mlx.core.array, NumPy array or list of ints, got {type(value).__name__}")
    try:
        values = np.asarray(value)
    except (ValueError, TypeError) as error:  # ragged nesting
        raise TypeError(f"{name}: expected a flat sequence of ints ({error})") from None
    if values.size and not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"{name}: expected ints, got {values.dtype} values")
    return values.astype(np.int64)


def check_batch_sizes(batch_sizes, total_rows: int | None = None, batch: int | None = None,
                      name: str = "batch_sizes", rows_name: str = "data") -> tuple[int, ...]:  # fmt: skip
    """A packed sequence's rows per time step, checked, as a tuple of ints.

    They must be a non-empty 1-D integer sequence, non-increasing, each at least 1,
    starting at ``batch`` and adding up to ``total_rows`` (the rows of ``rows_name``) where given.
    """
    if isinstance(batch_sizes, (list, tuple)) and batch_sizes and all(type(s) is int for s in batch_sizes):
        sizes = tuple(batch_sizes)  # the layers' own lists: no NumPy round trip
    else:
        vector = as_int_vector(batch_sizes, name)
        if vector.ndim != 1 or vector.size == 0:
            raise ValueError(f"{name}: expected a non-empty 1-D sequence, got shape {vector.shape}")
        sizes = tuple(vector.tolist())
    shown = list(sizes[:12])
    if sizes[-1] < 1 or any(later > earlier for earlier, later in itertools.pairwise(sizes)):
        raise ValueError(f"{name}: expected non-increasing sizes, each at least 1, got {shown}")
    if batch is not None and sizes[0] != batch:
        raise ValueError(f"{name}: expected the first size to be the batch size {batch}, got {shown}")
    if total_rows is not None and sum(sizes) != total_rows:
        raise ValueError(f"{name}: they add up to {sum(sizes)} rows, but {rows_name} has {total_rows} rows")
    return sizes


_FLOATING = frozenset(dtype for dtype in (mx.float16, mx.bfloat16, mx.float32, mx.float64))


def check_float_array(value, name: str, shape: tuple | None = None, dtype=None) -> None:
    """Raise unless ``value`` is a floating mx.array of ``dtype`` (if given) and ``shape`` (None entries: any size)."""
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array, got {type(value).__name__}")
    value_dtype = value.dtype
    if value_dtype not in _FLOATING:
        raise TypeError(f"{name}: expected a floating dtype, got {value_dtype}")
    if dtype is not None and value_dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (that of the other arguments), got {value_dtype}")
    if shape is None:
        return
    value_shape = value.shape
    if len(value_shape) != len(shape) or any(
        size is not None and size != got for size, got in zip(shape, value_shape, strict=True)
    ):
        expected = tuple("*" if size is None else size for size in shape)
        raise ValueError(f"{name}: expected shape {expected}".replace("'*'", "*") + f", got {tuple(value.shape)}")


def check_state(name: str, state) -> tuple[int, int]:
    """A recurrent state: a floating (B, H) mx.array with B, H >= 1.  Returns its shape."""
    check_float_array(state, name, (None, None))
    if state.size == 0:
        raise ValueError(f"{name}: expected a non-empty (batch, hidden_size) array, got shape {tuple(state.shape)}")
    return state.shape


def check_choice(name: str, value, choices: tuple) -> None:
    """Raise a ValueError unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
