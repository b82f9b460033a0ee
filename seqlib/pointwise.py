"""One recurrent step's gate math (the "pointwise" stage), forward and backward, on the MLX-ops path or the kernels.

A recurrent step is two matmuls and then elementwise gate math: sigmoids,
tanhs, products.  This module is that gate math for the LSTM, GRU and plain RNN,
written once per cell for a given ``tanh`` in two builds:

- **compiled**, with the rational ``tanh`` of :mod:`seqlib.activations`, which
  ``mx.compile`` fuses into a few vectorised loops;
- **eager**, with ``mx.tanh``, for calls under ``mx.grad``/``mx.vjp``: there MLX
  does not compile (its inputs are tracers), and one ``mx.tanh`` beats the dozen
  separate ops of an uncompiled rational.

Where seqlib runs its kernels (``seqlib.kernels.uses_kernels()``) the same
functions launch the fused Metal kernels of :mod:`seqlib.kernels.cell_kernels`
instead; :mod:`seqlib.scan` runs these step functions over whole sequences.

Shapes: B rows, H hidden units; the gate blocks are stacked along the last axis
(i, f, g, o for the LSTM; r, z, n for the GRU).  NaN in, NaN out, as in torch.
"""

from __future__ import annotations

import functools
import platform
import shutil

import mlx.core as mx

from seqlib import kernels
from seqlib._checks import check_choice, check_float_array, check_state
from seqlib.activations import fast_tanh
from seqlib.graph import is_traced

__all__ = [
    "gate_path",
    "gru_pointwise",
    "gru_pointwise_backward",
    "gru_step",
    "lstm_pointwise",
    "lstm_pointwise_backward",
    "lstm_step",
    "rnn_activation",
    "rnn_activation_backward",
    "rnn_step",
]


def _compile(function):
    """``mx.compile`` where it can run: on Linux the CPU backend needs a C++ compiler at run time."""
    if platform.system() == "Linux" and shutil.which("g++") is None:
        return function
    return mx.compile(function)


# ----------------------------------------------------------------- where the gate math runs


def _sigmoid(tanh, x):
    return 0.5 * tanh(0.5 * x) + 0.5


@functools.lru_cache(maxsize=64)
def _lstm_activation_constants(hidden_size: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Per column of the (B, 4H) gates: sigmoid(x) = 0.5 tanh(0.5 x) + 0.5 for i, f, o; tanh(x) for g."""
    half, one = mx.full((hidden_size,), 0.5, dtype), mx.ones((hidden_size,), dtype)
    zero = mx.zeros((hidden_size,), dtype)
    scale = mx.concatenate([half, half, one, half])
    shift = mx.concatenate([half, half, zero, half])
    mx.eval(scale, shift)
    return scale, shift


def _lstm_pointwise(tanh, gates, c_prev, scale, shift):
    activations = tanh(gates * scale) * scale + shift  # (B, 4H): sigmoid i, f, o and tanh g in one pass
    i, f, g, o = mx.split(activations, 4, axis=-1)
    c = f * c_prev + i * g
    tanh_c = tanh(c)
    return o * tanh_c, c, activations, tanh_c


_lstm_pointwise_compiled = _compile(functools.partial(_lstm_pointwise, fast_tanh))


def _lstm_step(x_gates, h_prev, c_prev, w_hh, scale, shift):
    gates = mx.addmm(x_gates, h_prev, w_hh.T)
    return _lstm_pointwise(fast_tanh, gates, c_prev, scale, shift)[:2]


_lstm_step_compiled = _compile(_lstm_step)


def lstm_step(x_gates: mx.array, h_prev: mx.array, c_prev: mx.array, w_hh: mx.array, plain: bool = False):
    """One LSTM step for inference, the recurrent matmul and the gate math compiled into one call.

    ``gates = x_gates + h_prev @ w_hh.T``, then :func:`lstm_pointwise`'s math; returns
    ``h (B, H), c (B, H)`` and saves nothing for a backward.  x_gates: (B, 4H) the input side
    ``x @ W_ih.T + b_ih + b_hh``; h_prev: (B, P); c_prev: (B, H); w_hh: (4H, P).  Arguments are
    not checked: callers (:mod:`seqlib.scan`, the layers' ``step``) have checked them.  Under
    a transformation (:func:`seqlib.graph.is_traced`) use the sequence functions of :mod:`seqlib.scan`, whose
    backward is written by hand.  ``plain``: MLX's built-in ops with ``mx.tanh``, uncompiled (the
    ``"plain"`` path of :mod:`seqlib.dispatch`: exportable, differentiable by MLX's autodiff).
    """
    scale, shift = _lstm_activation_constants(c_prev.shape[-1], c_prev.dtype)
    if plain:
        return _lstm_pointwise(mx.tanh, mx.addmm(x_gates, h_prev, w_hh.T), c_prev, scale, shift)[:2]
    return _lstm_step_compiled(x_gates, h_prev, c_prev, w_hh, scale, shift)


def gate_path(x: mx.array, use_kernels: bool | None = None) -> str:
    """Where gate math on ``x`` runs: ``"kernel"`` (seqlib's Metal kernels, when ``use_kernels``; None: where
    the backend runs them), else ``"compiled"`` or ``"eager"`` MLX ops (eager while ``x`` is being traced by
    ``mx.grad``/``mx.vjp``, or where ``mx.compile`` cannot run)."""
    if kernels.uses_kernels() if use_kernels is None else use_kernels:
        return "kernel"
    return "eager" if is_traced(x) else "compiled"


def _path(compiled: bool | None, x: mx.array) -> str:
    if compiled is None:
        return gate_path(x)
    return "compiled" if compiled else "eager"


def lstm_pointwise(gates: mx.array, c_prev: mx.array, compiled: bool | None = None):
    """The LSTM's gate math for one step.

    gates: (B, 4H) pre-activations in the order i, f, g, o; c_prev: (B, H), B and H at least 1,
    both of one floating dtype.  Returns ``h (B, H), c (B, H), activations (B, 4H), tanh_c (B, H)``;
    the last two are what the backward needs.  ``compiled``: which MLX-ops build to
    run (None: as :func:`gate_path` decides; the sequence loops decide once per sequence).
    NaN in, NaN out, as torch's sigmoid and tanh.
    """
    batch, hidden_size = check_state("c_prev", c_prev)
    check_float_array(gates, "gates", (batch, 4 * hidden_size), c_prev.dtype)
    return lstm_pointwise_on(_path(compiled, gates), gates, c_prev)




def lstm_pointwise_on(path: str, gates, c_prev):
    if path == "kernel":
        return kernels.lstm_pointwise(gates, c_prev)
    scale, shift = _lstm_activation_constants(c_prev.shape[-1], gates.dtype)
    if path == "compiled":
        return _lstm_pointwise_compiled(gates, c_prev, scale, shift)
    return _lstm_pointwise(mx.tanh, gates, c_prev, scale, shift)


def lstm_backward_on(path: str, d_h, d_c, activations, tanh_c, c_prev):
    if path == "kernel":
        return kernels.lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)
    return _lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)


def lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev):
    """Gradients through one step's gate math: returns ``d_gates (B, 4H), d_c_prev (B, H)``.

    d_h, d_c: the gradients arriving at this step's h and c (B, H); activations (B, 4H) and
    tanh_c (B, H) as :func:`lstm_pointwise` returned them; c_prev (B, H)."""
    batch, hidden_size = check_state("c_prev", c_prev)
    for name, array in (("d_h", d_h), ("d_c", d_c), ("tanh_c", tanh_c)):
        check_float_array(array, name, (batch, hidden_size), c_prev.dtype)
    check_float_array(activations, "activations", (batch, 4 * hidden_size), c_prev.dtype)
    return _lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)


@_compile
def _lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev):
    i, f, g, o = mx.split(activations, 4, axis=-1)
    d_c = d_c + d_h * o * (1 - tanh_c * tanh_c)
    d_i = d_c * g * i * (1 - i)
    d_f = d_c * c_prev * f * (1 - f)
    d_g = d_c * i * (1 - g * g)
    d_o = d_h * tanh_c * o * (1 - o)
    return mx.concatenate([d_i, d_f, d_g, d_o], axis=-1), d_c * f


def _gru_pointwise(tanh, input_side, hidden_side, h_prev):
    input_r, input_z, input_n = mx.split(input_side, 3, axis=-1)
    hidden_r, hidden_z, hidden_n = mx.split(hidden_side, 3, axis=-1)
    r = _sigmoid(tanh, input_r + hidden_r)
    z = _sigmoid(tanh, input_z + hidden_z)
    n = tanh(input_n + r * hidden_n)
    return n + z * (h_prev - n), mx.concatenate([r, z, n], axis=-1)  # (1 - z) n + z h, as torch rounds it


_gru_pointwise_compiled = _compile(functools.partial(_gru_pointwise, fast_tanh))


@_compile
def _gru_step(x_gates, h_prev, w_hh, b_hh):
    hidden_side = mx.addmm(b_hh, h_prev, w_hh.T)
    return _gru_pointwise(fast_tanh, x_gates, hidden_side, h_prev)[0]


def gru_step(x_gates: mx.array, h_prev: mx.array, w_hh: mx.array, b_hh: mx.array, plain: bool = False) -> mx.array:
    """One GRU step for inference, compiled into one call: the new ``h (B, H)``, nothing saved.

    ``hidden_side = h_prev @ w_hh.T + b_hh``, then :func:`gru_pointwise`'s math.  x_gates: (B, 3H)
    the input side ``x @ W_ih.T + b_ih``; h_prev: (B, H); w_hh: (3H, H); b_hh: (3H,).  Not checked,
    and not for use under a transformation, as :func:`lstm_step`; ``plain`` as there.
    """
    if plain:
        return _gru_pointwise(mx.tanh, x_gates, mx.addmm(b_hh, h_prev, w_hh.T), h_prev)[0]
    return _gru_step(x_gates, h_prev, w_hh, b_hh)


def gru_pointwise(input_side: mx.array, hidden_side: mx.array, h_prev: mx.array, compiled: bool | None = None):
    """The GRU's gate math for one step, with PyTorch's ``n = tanh(i_n + r * (W_hn h + b_hn))``.

    input_side: (B, 3H) ``W_ih x + b_ih``; hidden_side: (B, 3H) ``W_hh h + b_hh``; h_prev: (B, H).
    Returns ``h (B, H), activations (B, 3H)`` with activations r, z, n; ``compiled`` as in
    :func:`lstm_pointwise`.
    """
    batch, hidden_size = check_state("h_prev", h_prev)
    check_float_array(input_side, "input_side", (batch, 3 * hidden_size), h_prev.dtype)
    check_float_array(hidden_side, "hidden_side", (batch, 3 * hidden_size), h_prev.dtype)
    return gru_pointwise_on(_path(compiled, input_side), input_side, hidden_side, h_prev)


def gru_pointwise_on(path: str, input_side, hidden_side, h_prev):
    if path == "kernel":
        return kernels.gru_pointwise(input_side, hidden_side, h_prev)
    if path == "compiled":
        return _gru_pointwise_compiled(input_side, hidden_side, h_prev)
    return _gru_pointwise(mx.tanh, input_side, hidden_side, h_prev)


def gru_backward_on(path: str, d_h, activations, hidden_side, h_prev):
    if path == "kernel":
        return kernels.gru_pointwise_backward(d_h, activations, hidden_side, h_prev)
    return _gru_pointwise_backward(d_h, activations, hidden_side, h_prev)


def gru_pointwise_backward(d_h, activations, hidden_side, h_prev):
    """Returns ``d_input_side (B, 3H), d_hidden_side (B, 3H), d_h_prev`` (the direct part, without W_hh).

    d_h, h_prev: (B, H); activations (B, 3H) as :func:`gru_pointwise` returned them; hidden_side (B, 3H)."""
    batch, hidden_size = check_state("h_prev", h_prev)
    check_float_array(d_h, "d_h", (batch, hidden_size), h_prev.dtype)
    check_float_array(activations, "activations", (batch, 3 * hidden_size), h_prev.dtype)
    check_float_array(hidden_side, "hidden_side", (batch, 3 * hidden_size), h_prev.dtype)
    return _gru_pointwise_backward(d_h, activations, hidden_side, h_prev)


@_compile
def _gru_pointwise_backward(d_h, activations, hidden_side, h_prev):
    r, z, n = mx.split(activations, 3, axis=-1)
    hidden_n = mx.split(hidden_side, 3, axis=-1)[2]
    d_n = d_h * (1 - z) * (1 - n * n)
    d_z = d_h * (h_prev - n) * z * (1 - z)
    d_r = d_n * hidden_n * r * (1 - r)
    d_input_side = mx.concatenate([d_r, d_z, d_n], axis=-1)
    d_hidden_side = mx.concatenate([d_r, d_z, d_n * r], axis=-1)
    return d_input_side, d_hidden_side, d_h * z


_fast_tanh_compiled = _compile(fast_tanh)


def rnn_activation_on(path: str, nonlinearity: str, x: mx.array) -> mx.array:
    if path == "kernel":
        return kernels.rnn_activation(x, nonlinearity)
    if nonlinearity == "relu":
        return mx.maximum(x, 0)  # propagates NaN, as torch's relu
    return _fast_tanh_compiled(x) if path == "compiled" else mx.tanh(x)


@_compile
def _tanh_backward(d_h, h):
    return d_h * (1 - h * h)


def rnn_activation_backward_on(path: str, nonlinearity: str, d_h, h):
    if path == "kernel":
        return kernels.rnn_activation_backward(d_h, h, nonlinearity)
    if nonlinearity == "tanh":
        return _tanh_backward(d_h, h)
    return mx.where(h <= 0, 0, d_h)  # torch's threshold_backward: a NaN output passes its gradient on


@_compile
def _rnn_tanh_step(x_gates, h_prev, w_hh):
    return fast_tanh(mx.addmm(x_gates, h_prev, w_hh.T))


@_compile
def _rnn_relu_step(x_gates, h_prev, w_hh):
    return mx.maximum(mx.addmm(x_gates, h_prev, w_hh.T), 0)


def rnn_step(x_gates: mx.array, h_prev: mx.array, w_hh: mx.array, nonlinearity: str = "tanh",
             plain: bool = False) -> mx.array:  # fmt: skip
    """One Elman RNN step for inference, compiled into one call: ``act(x_gates + h_prev @ w_hh.T)``.

    x_gates: (B, H) the input side ``x @ W_ih.T + b_ih + b_hh``; h_prev: (B, H); w_hh: (H, H).
    Not checked, and not for use under a transformation, as :func:`lstm_step`; ``plain`` as there.
    """
    if plain:
        return rnn_activation_on("eager", nonlinearity, mx.addmm(x_gates, h_prev, w_hh.T))
    step = _rnn_tanh_step if nonlinearity == "tanh" else _rnn_relu_step
    return step(x_gates, h_prev, w_hh)


def rnn_activation(pre: mx.array, nonlinearity: str = "tanh", compiled: bool | None = None) -> mx.array:
    """The plain RNN's step nonlinearity: ``h = tanh(pre)`` or ``relu(pre)`` for pre (B, H).

    ``pre = W_ih x + b_ih + W_hh h_prev + b_hh``; ``compiled`` as in :func:`lstm_pointwise`."""
    check_choice("nonlinearity", nonlinearity, kernels.NONLINEARITIES)
    check_state("pre", pre)
    return rnn_activation_on(_path(compiled, pre), nonlinearity, pre)


def rnn_activation_backward(d_h: mx.array, h: mx.array, nonlinearity: str = "tanh") -> mx.array:
    """``d_pre (B, H)`` from :func:`rnn_activation`'s output h: ``d_h (1 - h^2)`` for tanh, ``d_h [h > 0]`` for relu."""
    check_choice("nonlinearity", nonlinearity, kernels.NONLINEARITIES)
    check_state("h", h)
    check_float_array(d_h, "d_h", h.shape, h.dtype)
    return rnn_activation_backward_on("compiled", nonlinearity, d_h, h)
