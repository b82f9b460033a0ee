"""Whole-sequence kernels: one recurrent layer-direction over packed rows in one dispatch.

``lstm_sequence.metal`` (and its teaching twin ``lstm_sequence_simple.metal``) and
``gru_sequence.metal`` keep the state of one sequence in threadgroup memory and
walk the time steps inside the kernel, so a whole layer is one launch instead of
one per step.  They serve small batches (each sequence re-reads W_hh every step;
above :data:`SEQUENCE_KERNEL_MAX_BATCH` one matmul per step wins) and
``hidden_size <= 1024`` (the state lives in 32 KB of threadgroup memory).

The forward launchers return, besides the output and final states, what
:mod:`seqlib.scan`'s backward needs; the backward itself is the per-step loop
over the cell kernels (:mod:`seqlib.kernels.cell_kernels`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from seqlib._checks import check_batch_sizes, check_choice, check_float_array, check_state
from seqlib.kernels.runtime import T, KernelSpec, build_kernel, check_kernel_dtype

__all__ = [
    "LSTM_SEQUENCE_VERSIONS",
    "SEQUENCE_KERNEL_MAX_BATCH",
    "SEQUENCE_KERNEL_MAX_HIDDEN",
    "gru_sequence_forward",
    "lstm_sequence_forward",
    "sequence_kernel_serves",
]

#: The largest hidden size the sequence kernels serve (their threadgroup arrays hold 1024 floats per state vector).
SEQUENCE_KERNEL_MAX_HIDDEN = 1024
#: The largest batch the sequence kernels serve (above it, one matmul per step beats re-reading W_hh per sequence).
SEQUENCE_KERNEL_MAX_BATCH = 8
SEQUENCE_THREADS = 256  # 8 SIMD groups per sequence
_STEPS = (("step_offsets", mx.int32), ("batch_sizes", mx.int32))
_LSTM_BUFFERS = (
    (("x_gates", T), ("w_hh", T), ("h0", T), ("c0", T), *_STEPS),
    tuple((name, T) for name in ("output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev")),
)
#: The two LSTM sequence kernels by version, ``"simd"`` (one SIMD group per unit, the default) and ``"simple"``
#: (one thread per hidden unit), for :func:`lstm_sequence_forward`'s ``version``.
#:
#: :meta hide-value:
LSTM_SEQUENCE_VERSIONS = {
    "simd": KernelSpec("lstm_sequence", *_LSTM_BUFFERS, template=(("T", T), ("REVERSE", False))),
    "simple": KernelSpec("lstm_sequence_simple", *_LSTM_BUFFERS, template=(("T", T), ("REVERSE", False))),
}
GRU_SEQUENCE = KernelSpec(
    "gru_sequence",
    (("x_gates", T), ("w_hh", T), ("b_hh", T), ("h0", T), *_STEPS),
    tuple((name, T) for name in ("output", "h_n", "activations", "hidden_side", "h_prev")),
    template=(("T", T), ("REVERSE", False)),
)
SPECS = (*LSTM_SEQUENCE_VERSIONS.values(), GRU_SEQUENCE)


def sequence_kernel_serves(batch: int, hidden_size: int) -> bool:
    """Whether the recurrent layers use the whole-sequence kernels for this shape (else one kernel per step)."""
    for name, value in (("batch", batch), ("hidden_size", hidden_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return batch <= SEQUENCE_KERNEL_MAX_BATCH and hidden_size <= SEQUENCE_KERNEL_MAX_HIDDEN


def _packed_steps(batch_sizes, total_rows: int, batch: int) -> tuple[mx.array, mx.array]:
    """(step_offsets, batch_sizes) as int32 arrays, after checking they describe ``total_rows`` packed rows
    of ``batch`` sequences (integers only: float sizes are refused, not truncated)."""
    sizes = np.array(check_batch_sizes(batch_sizes, total_rows, batch, rows_name="x_gates"), dtype=np.int64)
    step_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return mx.array(step_offsets.astype(np.int32)), mx.array(sizes.astype(np.int32))


def _check_sequence(x_gates, w_hh, h0, gate_blocks: int) -> tuple[int, int]:
    batch, hidden_size = check_state("h0", h0)
    check_kernel_dtype("h0", h0)
    if hidden_size > SEQUENCE_KERNEL_MAX_HIDDEN:
        raise ValueError(
            f"h0: the whole-sequence kernel serves hidden_size <= {SEQUENCE_KERNEL_MAX_HIDDEN} "
            f"(its state lives in 32 KB of threadgroup memory), got {hidden_size}"
        )
    check_float_array(x_gates, "x_gates", (None, gate_blocks * hidden_size), h0.dtype)
    check_float_array(w_hh, "w_hh", (gate_blocks * hidden_size, hidden_size), h0.dtype)
    return batch, hidden_size


def _sequence_launch(batch: int) -> dict:
    """One threadgroup of SEQUENCE_THREADS threads per sequence."""
    return {"grid": (SEQUENCE_THREADS, batch, 1), "threadgroup": (SEQUENCE_THREADS, 1, 1)}


def lstm_sequence_forward(x_gates, w_hh, h0, c0, batch_sizes, reverse: bool = False, version: str = "simd"):
    """lstm_sequence.metal: one LSTM layer-direction over packed rows, in one dispatch.

    x_gates (N, 4H) = x W_ih^T + b_ih + b_hh; w_hh (4H, H); h0, c0 (B, H);
    batch_sizes: rows per step (a PackedSequence's).  Returns
    ``output (N, H), h_n, c_n (B, H), activations (N, 4H), tanh_c, c_prev, h_prev (N, H)``:
    the last four are what the backward of :func:`seqlib.scan.lstm_sequence` needs.
    ``version``: ``"simd"`` (one SIMD group per unit) or ``"simple"`` (one thread per unit).
    """
    check_choice("version", version, tuple(LSTM_SEQUENCE_VERSIONS))
    batch, hidden_size = _check_sequence(x_gates, w_hh, h0, 4)
    check_float_array(c0, "c0", h0.shape, h0.dtype)
    step_offsets, sizes = _packed_steps(batch_sizes, x_gates.shape[0], batch)
    kernel = build_kernel(LSTM_SEQUENCE_VERSIONS[version])
    rows = (x_gates.shape[0], hidden_size)
    return tuple(
        kernel(
            inputs=[x_gates, w_hh, h0, c0, step_offsets, sizes],
            template=[("T", h0.dtype), ("REVERSE", bool(reverse))],
            output_shapes=[rows, h0.shape, h0.shape, x_gates.shape, rows, rows, rows],
            output_dtypes=[h0.dtype] * 7,
            **_sequence_launch(batch),
        )
    )


def gru_sequence_forward(x_gates, w_hh, b_hh, h0, batch_sizes, reverse: bool = False):
    """gru_sequence.metal: one GRU layer-direction over packed rows, in one dispatch.

    x_gates (N, 3H) = x W_ih^T + b_ih; w_hh (3H, H); b_hh (3H,); h0 (B, H).  Returns
    ``output (N, H), h_n (B, H), activations (N, 3H), hidden_side (N, 3H), h_prev (N, H)``:
    the last three are what the backward of :func:`seqlib.scan.gru_sequence` needs.
    """
    batch, hidden_size = _check_sequence(x_gates, w_hh, h0, 3)
    check_float_array(b_hh, "b_hh", (3 * hidden_size,), h0.dtype)
    step_offsets, sizes = _packed_steps(batch_sizes, x_gates.shape[0], batch)
    kernel = build_kernel(GRU_SEQUENCE)
    rows = (x_gates.shape[0], hidden_size)
    return tuple(
        kernel(
            inputs=[x_gates, w_hh, b_hh, h0, step_offsets, sizes],
            template=[("T", h0.dtype), ("REVERSE", bool(reverse))],
            output_shapes=[rows, h0.shape, x_gates.shape, x_gates.shape, rows],
            output_dtypes=[h0.dtype] * 5,
            **_sequence_launch(batch),
        )
    )
