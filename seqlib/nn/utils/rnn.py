"""Batches of sequences of different lengths, with PyTorch's ``torch.nn.utils.rnn`` API and layout.

A :class:`PackedSequence` stores a batch without padding, **time-major**: all
sequences' first steps, then all second steps, and so on, longest sequences
first.  ``batch_sizes[t]`` says how many sequences are still running at step t,
so a recurrent layer does exactly ``batch_sizes[t]`` rows of work at step t.

    lengths 4, 2, 1 (sorted)       data rows          batch_sizes
    a0 a1 a2 a3                    a0 b0 c0           3
    b0 b1                          a1 b1              2
    c0                             a2                 1
                                   a3                 1

``sorted_indices[k]`` is the original batch position of the k-th longest
sequence; ``unsorted_indices`` is its inverse.  Both are None when the input
was already sorted (``enforce_sorted=True``), exactly as in torch.  Packing and
unpacking are gathers, so gradients flow through them.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

__all__ = [
    "PackedSequence",
    "pack_padded_sequence",
    "pack_sequence",
    "pad_packed_sequence",
    "pad_sequence",
    "unpack_sequence",
]


class PackedSequence(NamedTuple):
    data: mx.array  # (sum of lengths, *features), time-major
    batch_sizes: mx.array  # (max length,) int64: sequences still running at each step
    sorted_indices: mx.array | None = None  # (B,) int64: original position of the k-th longest
    unsorted_indices: mx.array | None = None  # (B,) int64: the inverse permutation

    def lengths(self) -> np.ndarray:
        """Each sequence's length, in the original batch order."""
        sizes = np.array(self.batch_sizes)
        sorted_lengths = (sizes[None, :] > np.arange(sizes[0])[:, None]).sum(axis=1)
        if self.unsorted_indices is None:
            return sorted_lengths
        return sorted_lengths[np.array(self.unsorted_indices)]


def check_packed_sequence(value, name: str = "input") -> PackedSequence:
    """Raise a TypeError for something that looks like a PackedSequence but is not seqlib's."""
    if isinstance(value, PackedSequence):
        return value
    if type(value).__name__ == "PackedSequence":
        raise TypeError(
            f"{name}: expected a seqlib.nn.utils.rnn.PackedSequence, got {type(value).__module__}.PackedSequence; "
            "pack the MLX arrays with seqlib.nn.utils.rnn.pack_padded_sequence instead"
        )
    raise TypeError(f"{name}: expected a seqlib.nn.utils.rnn.PackedSequence, got {type(value).__name__}")


def _as_lengths(lengths, batch_size: int, max_length: int) -> np.ndarray:
    """lengths (list, NumPy or MLX array, or torch tensor) as a checked int64 NumPy vector."""
    if hasattr(lengths, "detach"):  # a torch tensor
        lengths = lengths.detach().cpu().numpy()
    values = np.array(lengths)
    if values.ndim != 1 or not (values.size == 0 or np.issubdtype(values.dtype, np.integer)):
        raise TypeError(f"lengths: expected a 1-D sequence of ints, got {values.dtype} with shape {values.shape}")
    if values.size != batch_size:
        raise ValueError(f"lengths: expected one length per sequence ({batch_size}), got {values.size}")
    if values.size and (values.min() < 1 or values.max() > max_length):
        raise ValueError(
            f"lengths: every length must lie in [1, {max_length}] (the padded length); "
            f"got values from {values.min()} to {values.max()}"
        )
    return values.astype(np.int64)


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
    """Pack a padded batch (T, B, *) (or (B, T, *) with ``batch_first``) of sequences with the given lengths."""
    if not isinstance(input, mx.array):
        raise TypeError(f"input: expected an mlx.core.array, got {type(input).__name__}")
    if input.ndim < 2:
        raise ValueError(f"input: expected at least 2 dimensions (time, batch, ...), got shape {tuple(input.shape)}")
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
    sequence = check_packed_sequence(sequence, "sequence")
    batch_sizes = np.array(sequence.batch_sizes)
    batch_size, max_length = int(batch_sizes[0]), len(batch_sizes)
    if total_length is not None:
        if total_length < max_length:
            raise ValueError(
                f"total_length: expected at least the longest sequence's length {max_length}, got {total_length}"
            )
        max_length = total_length
    lengths = sequence.lengths()
    batch_position = np.arange(batch_size) if sequence.unsorted_indices is None else np.array(sequence.unsorted_indices)
    # For each padded cell (t, original b): its packed row, or the extra padding row at the end
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    padding_row = int(offsets[-1])
    steps = np.arange(max_length)[:, None]
    sorted_position = batch_position[None, :]
    inside = steps < lengths[None, :]
    packed_rows = np.where(inside, offsets[np.minimum(steps, len(batch_sizes) - 1)] + sorted_position, padding_row)
    data = sequence.data
    padding = mx.full((1, *data.shape[1:]), padding_value, data.dtype)
    padded = mx.concatenate([data, padding], axis=0)[mx.array(packed_rows.reshape(-1))]
    padded = padded.reshape(max_length, batch_size, *data.shape[1:])
    if batch_first:
        padded = padded.swapaxes(0, 1)
    return padded, mx.array(lengths)


def pad_sequence(sequences, batch_first: bool = False, padding_value: float = 0.0, padding_side: str = "right"):
    """Stack sequences of shape (L_k, *) into (T, B, *) (or (B, T, *)), padding each to the longest."""
    sequences = list(sequences)
    if not sequences or not all(isinstance(s, mx.array) and s.ndim >= 1 for s in sequences):
        raise TypeError("sequences: expected a non-empty list of mlx.core.array with at least 1 dimension each")
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side: expected 'right' or 'left', got {padding_side!r}")
    features = sequences[0].shape[1:]
    if any(s.shape[1:] != features for s in sequences):
        shapes = [tuple(s.shape) for s in sequences]
        raise ValueError(f"sequences: expected the same trailing shape (*, {features}) for all, got {shapes}")
    max_length = max(s.shape[0] for s in sequences)
    padded = []
    for s in sequences:
        pad = mx.full((max_length - s.shape[0], *features), padding_value, s.dtype)
        padded.append(mx.concatenate([s, pad] if padding_side == "right" else [pad, s], axis=0))
    return mx.stack(padded, axis=0 if batch_first else 1)


def pack_sequence(sequences, enforce_sorted: bool = True) -> PackedSequence:
    """Pack a list of sequences (L_k, *) of different lengths."""
    lengths = [s.shape[0] for s in sequences] if isinstance(sequences, (list, tuple)) else None
    return pack_padded_sequence(pad_sequence(sequences), lengths, enforce_sorted=enforce_sorted)


def unpack_sequence(packed_sequences: PackedSequence) -> list[mx.array]:
    """The list of sequences (L_k, *) in the original order: the inverse of :func:`pack_sequence`."""
    padded, lengths = pad_packed_sequence(packed_sequences, batch_first=True)
    return [padded[b, :length] for b, length in enumerate(lengths.tolist())]
