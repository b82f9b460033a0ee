"""The fused pointwise kernels of one recurrent step: ``lstm_cell``, ``gru_cell``, ``rnn_cell`` and their backwards.

Each launcher has the contract of its MLX-ops twin in :mod:`seqlib.pointwise`
(same arguments, same outputs, same checks); the step's matmuls stay with the
caller.  One thread per (row, unit): the gate blocks of a unit are read once
and every output of the step is written in the same pass.
"""

from __future__ import annotations

import mlx.core as mx

from seqlib._checks import check_choice, check_float_array, check_state
from seqlib.kernels.runtime import T, KernelSpec, build_kernel, check_kernel_dtype, elementwise_launch

__all__ = [
    "NONLINEARITIES",
    "gru_pointwise",
    "gru_pointwise_backward",
    "lstm_pointwise",
    "lstm_pointwise_backward",
    "rnn_activation",
    "rnn_activation_backward",
]

#: The nonlinearities of an Elman RNN (``nonlinearity`` of :class:`seqlib.nn.RNN`) that :func:`rnn_activation` takes.
NONLINEARITIES = ("tanh", "relu")


def _floats(*names: str) -> tuple:
    return tuple((name, T) for name in names)


LSTM_CELL = KernelSpec("lstm_cell", _floats("gates", "c_prev"), _floats("h", "c", "activations", "tanh_c"))
LSTM_CELL_BACKWARD = KernelSpec(
    "lstm_cell_backward", _floats("d_h", "d_c", "activations", "tanh_c", "c_prev"), _floats("d_gates", "d_c_prev")
)
GRU_CELL = KernelSpec("gru_cell", _floats("input_side", "hidden_side", "h_prev"), _floats("h", "activations"))
GRU_CELL_BACKWARD = KernelSpec(
    "gru_cell_backward",
    _floats("d_h", "activations", "hidden_side", "h_prev"),
    _floats("d_input_side", "d_hidden_side", "d_h_prev"),
)
RNN_CELL = KernelSpec("rnn_cell", _floats("pre"), _floats("h"), template=(("T", T), ("RELU", False)))
RNN_CELL_BACKWARD = KernelSpec(
    "rnn_cell_backward", _floats("d_h", "h"), _floats("d_pre"), template=(("T", T), ("RELU", False))
)
SPECS = (LSTM_CELL, LSTM_CELL_BACKWARD, GRU_CELL, GRU_CELL_BACKWARD, RNN_CELL, RNN_CELL_BACKWARD)


def lstm_pointwise(gates: mx.array, c_prev: mx.array):
    """lstm_cell.metal: ``h, c (B, H), activations (B, 4H), tanh_c (B, H)`` from gates (B, 4H) and c_prev (B, H).

    Contract of :func:`seqlib.pointwise.lstm_pointwise`: gates in the order i, f, g, o;
    ``c = f * c_prev + i * g`` and ``h = o * tanh(c)`` with i, f, o sigmoids and g a tanh.
    """
    batch, hidden_size = check_state("c_prev", c_prev)
    check_kernel_dtype("c_prev", c_prev)
    check_float_array(gates, "gates", (batch, 4 * hidden_size), c_prev.dtype)
    kernel = build_kernel(LSTM_CELL)
    return tuple(
        kernel(
            inputs=[gates, c_prev],
            template=[("T", c_prev.dtype)],
            output_shapes=[c_prev.shape, c_prev.shape, gates.shape, c_prev.shape],
            output_dtypes=[c_prev.dtype] * 4,
            **elementwise_launch(batch, hidden_size),
        )
    )


def lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev):
    """lstm_cell_backward.metal: ``d_gates (B, 4H), d_c_prev (B, H)``
    (contract of :func:`seqlib.pointwise.lstm_pointwise_backward`)."""
    batch, hidden_size = check_state("c_prev", c_prev)
    check_kernel_dtype("c_prev", c_prev)
    for name, array in (("d_h", d_h), ("d_c", d_c), ("tanh_c", tanh_c)):
        check_float_array(array, name, (batch, hidden_size), c_prev.dtype)
    check_float_array(activations, "activations", (batch, 4 * hidden_size), c_prev.dtype)
    kernel = build_kernel(LSTM_CELL_BACKWARD)
    return tuple(
        kernel(
            inputs=[d_h, d_c, activations, tanh_c, c_prev],
            template=[("T", c_prev.dtype)],
            output_shapes=[activations.shape, c_prev.shape],
            output_dtypes=[c_prev.dtype] * 2,
            **elementwise_launch(batch, hidden_size),
        )
    )


def gru_pointwise(input_side: mx.array, hidden_side: mx.array, h_prev: mx.array):
    """gru_cell.metal: ``h (B, H), activations (B, 3H)`` (contract of :func:`seqlib.pointwise.gru_pointwise`):
    ``r, z = sigmoid(i_r + h_r), sigmoid(i_z + h_z)``, ``n = tanh(i_n + r * h_n)``, ``h = (1 - z) n + z h_prev``."""
    batch, hidden_size = check_state("h_prev", h_prev)
    check_kernel_dtype("h_prev", h_prev)
    check_float_array(input_side, "input_side", (batch, 3 * hidden_size), h_prev.dtype)
    check_float_array(hidden_side, "hidden_side", (batch, 3 * hidden_size), h_prev.dtype)
    kernel = build_kernel(GRU_CELL)
    return tuple(
        kernel(
            inputs=[input_side, hidden_side, h_prev],
            template=[("T", h_prev.dtype)],
            output_shapes=[h_prev.shape, input_side.shape],
            output_dtypes=[h_prev.dtype] * 2,
            **elementwise_launch(batch, hidden_size),
        )
    )


def gru_pointwise_backward(d_h, activations, hidden_side, h_prev):
    """gru_cell_backward.metal: ``d_input_side, d_hidden_side (B, 3H), d_h_prev (B, H)``
    (contract of :func:`seqlib.pointwise.gru_pointwise_backward`)."""
    batch, hidden_size = check_state("h_prev", h_prev)
    check_kernel_dtype("h_prev", h_prev)
    check_float_array(d_h, "d_h", (batch, hidden_size), h_prev.dtype)
    check_float_array(activations, "activations", (batch, 3 * hidden_size), h_prev.dtype)
    check_float_array(hidden_side, "hidden_side", (batch, 3 * hidden_size), h_prev.dtype)
    kernel = build_kernel(GRU_CELL_BACKWARD)
    return tuple(
        kernel(
            inputs=[d_h, activations, hidden_side, h_prev],
            template=[("T", h_prev.dtype)],
            output_shapes=[activations.shape, activations.shape, h_prev.shape],
            output_dtypes=[h_prev.dtype] * 3,
            **elementwise_launch(batch, hidden_size),
        )
    )


def rnn_activation(pre: mx.array, nonlinearity: str = "tanh") -> mx.array:
    """rnn_cell.metal: ``h = tanh(pre)`` or ``relu(pre)`` for pre (B, H) (NaN stays NaN, as in torch)."""
    check_choice("nonlinearity", nonlinearity, NONLINEARITIES)
    check_state("pre", pre)
    check_kernel_dtype("pre", pre)
    kernel = build_kernel(RNN_CELL)
    return kernel(
        inputs=[pre],
        template=[("T", pre.dtype), ("RELU", nonlinearity == "relu")],
        output_shapes=[pre.shape],
        output_dtypes=[pre.dtype],
        **elementwise_launch(*pre.shape),
    )[0]


def rnn_activation_backward(d_h: mx.array, h: mx.array, nonlinearity: str = "tanh") -> mx.array:
    """rnn_cell_backward.metal: ``d_pre (B, H)`` from rnn_activation's output h:
    ``d_h (1 - h^2)`` for tanh, ``d_h [h > 0]`` for relu (a NaN output passes its gradient on, as in torch)."""
    check_choice("nonlinearity", nonlinearity, NONLINEARITIES)
    check_state("h", h)
    check_kernel_dtype("h", h)
    check_float_array(d_h, "d_h", h.shape, h.dtype)
    kernel = build_kernel(RNN_CELL_BACKWARD)
    return kernel(
        inputs=[d_h, h],
        template=[("T", h.dtype), ("RELU", nonlinearity == "relu")],
        output_shapes=[h.shape],
        output_dtypes=[h.dtype],
        **elementwise_launch(*h.shape),
    )[0]
