"""Batches of sequences of different lengths, with PyTorch's ``torch.nn.utils.rnn`` API and layout.

A :class:`PackedSequence` stores a batch without padding, **time-major**: all
sequences' first steps, then all second steps, and so on, longest sequences
first.  ``batch_sizes[t]`` says how many sequences are still running at step t,
so a recurrent layer does exactly ``batch_sizes[t]`` rows of work at step t::

    lengths 4, 2, 1 (sorted)       data rows          batch_sizes
    a0 a1 a2 a3                    a0 b0 c0           3
    b0 b1                          a1 b1              2
    c0                             a2                 1
                                   a3                 1

``sorted_indices[k]`` is the original batch position of the k-th longest
sequence; ``unsorted_indices`` is its inverse.  Both are None when the input
was already sorted (``enforce_sorted=True``), exactly as in torch.  Packing and
unpacking are gathers, so gradients flow through them.

A PackedSequence can also be built by hand; every consumer (the recurrent
layers, :func:`pad_packed_sequence`, :func:`unpack_sequence`) first passes it
through :func:`check_packed_sequence`, which refuses batch sizes and index
permutations that do not describe a packed batch before anything is gathered.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from seqlib._checks import as_int_vector, check_batch_sizes

__all__ = [
    "PackedSequence",
    "check_packed_sequence",
    "pack_padded_sequence",
    "pack_sequence",
    "pad_packed_sequence",
    "pad_sequence",
    "unpack_sequence",
]


class PackedSequence(NamedTuple):
    """A batch of sequences of different lengths without padding, time-major: torch's ``PackedSequence``.

    Made by :func:`pack_padded_sequence` or :func:`pack_sequence`; the recurrent layers take it as
    input and return their output packed the same way; :func:`pad_packed_sequence` pads it again.
    For a batch of B sequences with lengths L_1 >= ... >= L_B (after sorting), step t holds
    ``batch_sizes[t]`` rows, the t-th step of every sequence longer than t, so ``data`` has
    ``sum(lengths)`` rows.  A tuple, as in torch: ``data, batch_sizes, *_ = packed`` works.
    """

    #: Every sequence's steps, time-major, shape ``(sum of lengths, *features)``.
    data: mx.array
    #: How many sequences are still running at each step, shape ``(max length,)``, int64.
    batch_sizes: mx.array
    #: The original batch position of the k-th longest sequence, shape ``(B,)``, int64 (None if sorted).
    sorted_indices: mx.array | None = None
    #: The inverse permutation of ``sorted_indices``, shape ``(B,)``, int64 (None if sorted).
    unsorted_indices: mx.array | None = None

    def lengths(self) -> np.ndarray:
        """Each sequence's length, in the original batch order (the sequence is checked first)."""
        layout = _layout(self, "self")
        sizes = layout.batch_sizes
        sorted_lengths = (sizes[None, :] > np.arange(sizes[0])[:, None]).sum(axis=1)
        return sorted_lengths if layout.unsorted is None else sorted_lengths[layout.unsorted]


class _Layout(NamedTuple):
    """A checked PackedSequence with its batch sizes and batch order as NumPy arrays."""

    sequence: PackedSequence
    batch_sizes: np.ndarray  # (T,) int64
    unsorted: np.ndarray | None  # (B,) int64, or None for the identity


def check_packed_sequence(value, name: str = "input") -> PackedSequence:
    """``value`` checked to be a well-formed seqlib :class:`PackedSequence`, or a clear error.

    ``data`` must be an mlx.core.array with at least one dimension; ``batch_sizes`` a
    non-empty 1-D integer sequence, non-increasing, each at least 1, adding up to
    ``data``'s rows; ``sorted_indices`` and ``unsorted_indices`` 1-D integer permutations
    of ``range(batch_sizes[0])``, inverse to each other.  Returns the sequence with
    ``batch_sizes`` as an int64 array and, where only one of the two index arrays
    was given, the other filled in as its inverse (torch fills in ``unsorted_indices``
    the same way).
    """
    return _layout(value, name).sequence


def _layout(value, name: str) -> _Layout:
    if not isinstance(value, PackedSequence):
        if type(value).__name__ == "PackedSequence":
            raise TypeError(
                f"{name}: expected a seqlib.nn.utils.rnn.PackedSequence, got {type(value).__module__}.PackedSequence; "
                "pack the MLX arrays with seqlib.nn.utils.rnn.pack_padded_sequence instead"
            )
        raise TypeError(f"{name}: expected a seqlib.nn.utils.rnn.PackedSequence, got {type(value).__name__}")
    data = value.data
    if not isinstance(data, mx.array):
        raise TypeError(f"{name}.data: expected an mlx.core.array, got {type(data).__name__}")
    if data.ndim < 1:
        raise ValueError(f"{name}.data: expected at least 1 dimension (packed rows, *), got shape {tuple(data.shape)}")
    sizes = np.array(check_batch_sizes(value.batch_sizes, data.shape[0], None, f"{name}.batch_sizes", f"{name}.data"))
    batch = int(sizes[0])
    order = _permutation(value.sorted_indices, batch, f"{name}.sorted_indices")
    inverse = _permutation(value.unsorted_indices, batch, f"{name}.unsorted_indices")
    if order is not None and inverse is not None and np.any(order[inverse] != np.arange(batch)):
        raise ValueError(
            f"{name}: unsorted_indices must be the inverse permutation of sorted_indices, got "
            f"sorted_indices={order.tolist()[:12]} and unsorted_indices={inverse.tolist()[:12]}"
        )
    if order is None and inverse is not None:
        order = np.argsort(inverse)
    elif inverse is None and order is not None:
        inverse = np.argsort(order)
    indices = (None, None) if order is None else (mx.array(order), mx.array(inverse))
    return _Layout(PackedSequence(data, mx.array(sizes), *indices), sizes, inverse)


def _permutation(indices, batch: int, name: str) -> np.ndarray | None:
    """``indices`` (None, or an integer array) checked to be a permutation of range(batch), as int64 NumPy."""
    if indices is None:
        return None
    values = as_int_vector(indices, name)
    if values.ndim != 1 or values.size != batch:
        raise ValueError(
            f"{name}: expected a 1-D array of {batch} indices (one per sequence, batch_sizes[0]={batch}), "
            f"got shape {values.shape}"
        )
    if values.min() < 0 or values.max() >= batch:
        raise IndexError(
            f"{name}: every index must lie in [0, {batch}) (the batch size); "
            f"got values from {values.min()} to {values.max()}"
        )
    if np.bincount(values, minlength=batch).max() > 1:
        raise ValueError(f"{name}: expected a permutation of range({batch}), got {values.tolist()[:12]}")
    return values


def _as_lengths(lengths, batch_size: int, max_length: int) -> np.ndarray:
    """lengths (list, NumPy or MLX array, or torch tensor) as a checked int64 NumPy vector.

    Unlike torch, which truncates them, float lengths are refused: pass integers."""
    if hasattr(lengths, "detach"):  # a torch tensor
        lengths = lengths.detach().cpu().numpy()
    values = as_int_vector(lengths, "lengths")
    if values.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D sequence of ints, got shape {values.shape}")
    if values.size != batch_size:
        raise ValueError(f"lengths: expected one length per sequence ({batch_size}), got {values.size}")
    if values.min() < 1 or values.max() > max_length:
        raise ValueError(
            f"lengths: every length must lie in [1, {max_length}] (the padded length); "
            f"got values from {values.min()} to {values.max()}"
        )
    return values


def _packing_order(lengths: np.ndarray, enforce_sorted: bool) -> np.ndarray | None:
    if enforce_sorted:
        if np.any(np.diff(lengths) > 0):
            raise ValueError(
                f"lengths: must be sorted in decreasing order when enforce_sorted=True, got {lengths.tolist()}; "
                "pass enforce_sorted=False to sort them"
            )
        return None
    return np.argsort(-lengths, kind="stable")  # ties keep their order, as torch's sort does


def _batch_sizes(sorted_lengths: np.ndarray) -> np.ndarray:
    steps = np.arange(sorted_lengths[0])
    return (sorted_lengths[None, :] > steps[:, None]).sum(axis=1).astype(np.int64)


def pack_padded_sequence(input: mx.array, lengths, batch_first: bool = False, enforce_sorted: bool = True):
    """Pack a padded batch ``(T, B, *)`` (or ``(B, T, *)`` with ``batch_first``) of sequences with the given lengths.

    lengths: B integers in [1, T] (a list, NumPy, MLX or torch array); floats are refused, where
    torch truncates them.  An empty batch (T or B zero) cannot be packed, as in torch.
    """
    if not isinstance(input, mx.array):
        raise TypeError(f"input: expected an mlx.core.array, got {type(input).__name__}")
    if input.ndim < 2:
        raise ValueError(f"input: expected at least 2 dimensions (time, batch, ...), got shape {tuple(input.shape)}")
    if input.shape[0] == 0 or input.shape[1] == 0:
        layout = "(batch, time, ...)" if batch_first else "(time, batch, ...)"
        raise ValueError(
            f"input: cannot pack an empty batch: expected at least one step and one sequence in {layout}, "
            f"got shape {tuple(input.shape)}"
        )
    if batch_first:
        input = input.swapaxes(0, 1)
    max_length, batch_size = input.shape[:2]
    lengths = _as_lengths(lengths, batch_size, max_length)
    order = _packing_order(lengths, enforce_sorted)
    sorted_lengths = lengths if order is None else lengths[order]
    batch_sizes = _batch_sizes(sorted_lengths)
    columns = np.arange(batch_size) if order is None else order
    # row t*B + b of the flattened padded batch, for each packed row (t, k < batch_sizes[t])
    flat_rows = np.concatenate([t * batch_size + columns[:size] for t, size in enumerate(batch_sizes)])
    data = input.reshape(max_length * batch_size, *input.shape[2:])[mx.array(flat_rows)]
    if order is None:
        return PackedSequence(data, mx.array(batch_sizes))
    unsorted = np.argsort(order)
    return PackedSequence(data, mx.array(batch_sizes), mx.array(order.astype(np.int64)), mx.array(unsorted))


def pad_packed_sequence(
    sequence: PackedSequence, batch_first: bool = False, padding_value: float = 0.0, total_length: int | None = None
):
    """The inverse of :func:`pack_padded_sequence`: returns ``(padded, lengths)``, lengths in the original order."""
    layout = _layout(sequence, "sequence")
    _check_padding_value(padding_value)
    batch_sizes = layout.batch_sizes
    batch_size, max_length = int(batch_sizes[0]), len(batch_sizes)
    if total_length is not None:
        if not isinstance(total_length, (int, np.integer)) or isinstance(total_length, bool):
            raise TypeError(f"total_length: expected an int or None, got {type(total_length).__name__}")
        if total_length < max_length:
            raise ValueError(
                f"total_length: expected at least the longest sequence's length {max_length}, got {total_length}"
            )
        max_length = int(total_length)
    lengths = layout.sequence.lengths()
    batch_position = np.arange(batch_size) if layout.unsorted is None else layout.unsorted
    # For each padded cell (t, original b): its packed row, or the extra padding row at the end
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    padding_row = int(offsets[-1])
    steps = np.arange(max_length)[:, None]
    sorted_position = batch_position[None, :]
    inside = steps < lengths[None, :]
    packed_rows = np.where(inside, offsets[np.minimum(steps, len(batch_sizes) - 1)] + sorted_position, padding_row)
    data = layout.sequence.data
    padding = mx.full((1, *data.shape[1:]), padding_value, data.dtype)
    padded = mx.concatenate([data, padding], axis=0)[mx.array(packed_rows.reshape(-1))]
    padded = padded.reshape(max_length, batch_size, *data.shape[1:])
    if batch_first:
        padded = padded.swapaxes(0, 1)
    return padded, mx.array(lengths)


def _check_padding_value(padding_value) -> None:
    if not isinstance(padding_value, numbers.Real):
        raise TypeError(f"padding_value: expected a real number, got {type(padding_value).__name__}")


def _as_sequence_list(sequences) -> list[mx.array]:
    """``sequences`` (a list, tuple or iterable of arrays, or an array iterated along its first axis) as a list."""
    if isinstance(sequences, mx.array) and sequences.ndim < 2:
        raise ValueError(
            f"sequences: an array is read as a batch of sequences along its first axis and needs at least "
            f"2 dimensions, got shape {tuple(sequences.shape)}"
        )
    try:
        sequences = list(sequences)
    except TypeError:
        raise TypeError(f"sequences: expected a list of mlx.core.array, got {type(sequences).__name__}") from None
    if not sequences:
        raise TypeError("sequences: expected a non-empty list of mlx.core.array, got an empty one")
    for position, sequence in enumerate(sequences):
        if not isinstance(sequence, mx.array):
            raise TypeError(f"sequences[{position}]: expected an mlx.core.array, got {type(sequence).__name__}")
        if sequence.ndim < 1:
            raise ValueError(f"sequences[{position}]: expected at least 1 dimension (length, *), got a scalar")
    return sequences


def pad_sequence(sequences, batch_first: bool = False, padding_value: float = 0.0, padding_side: str = "right"):
    """Stack sequences of shape ``(L_k, *)`` into ``(T, B, *)`` (or ``(B, T, *)``), padding each to the longest.

    As in torch, the result has the first sequence's dtype; sequences of length 0 are allowed.
    """
    sequences = _as_sequence_list(sequences)
    _check_padding_value(padding_value)
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
    features, dtype = sequences[0].shape[1:], sequences[0].dtype
    if any(s.shape[1:] != features for s in sequences):
        shapes = [tuple(s.shape) for s in sequences]
        raise ValueError(f"sequences: expected the same trailing shape (*, {features}) for all, got {shapes}")
    max_length = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        pad = mx.full((max_length - s.shape[0], *features), padding_value, dtype)
        s = s.astype(dtype)
        padded.append(mx.concatenate([s, pad] if padding_side == "right" else [pad, s], axis=0))
    return mx.stack(padded, axis=0 if batch_first else 1)


def pack_sequence(sequences, enforce_sorted: bool = True) -> PackedSequence:
    """Pack a list of sequences ``(L_k, *)`` of different lengths, each at least one step long."""
    sequences = _as_sequence_list(sequences)
    lengths = [s.shape[0] for s in sequences]
    if min(lengths) < 1:
        empty = lengths.index(0)
        raise ValueError(
            f"sequences: every sequence needs at least one step to be packed; "
            f"sequences[{empty}] has shape {tuple(sequences[empty].shape)}"
        )
    return pack_padded_sequence(pad_sequence(sequences), lengths, enforce_sorted=enforce_sorted)


def unpack_sequence(packed_sequences: PackedSequence) -> list[mx.array]:
    """The list of sequences ``(L_k, *)`` in the original order: the inverse of :func:`pack_sequence`."""
    packed_sequences = check_packed_sequence(packed_sequences, "packed_sequences")
    padded, lengths = pad_packed_sequence(packed_sequences, batch_first=True)
    return [padded[b, :length] for b, length in enumerate(lengths.tolist())]
