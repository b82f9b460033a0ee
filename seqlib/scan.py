"""One recurrent layer, one direction, over a whole sequence: the scan over time steps, with its own backward.

The layers in :mod:`seqlib.nn` (and the cells, which are sequences of length
one) all end here.  The structure is the one fast implementations share
(Appleyard et al. 2016, cuDNN):

1. The input side of every gate, for every time step, is **one matmul** done by
   the caller: ``x_gates = x @ W_ih.T`` with x all ``N`` rows of the sequence, its
   bias ``b`` passed beside it (``input_bias``): the C++ loops add it as they read
   each row, which saves a pass over the (N, G H) array (the other paths add it
   first).  :func:`lstm_input_sequence` and :func:`gru_input_sequence` take
   the input and ``W_ih`` instead: where seqlib's C++ loop runs and the input
   is narrow, the loop computes each step's input side itself, and ``x_gates``
   is never written.
2. Each step then needs only the recurrent matmul ``h @ W_hh.T`` and the
   **fused pointwise gate math** of :mod:`seqlib.pointwise` (one compiled
   function, or one fused kernel).
3. The backward is written by hand (backpropagation through time, as in
   :mod:`seqlib.reference`): it walks the steps in reverse doing only what must
   be sequential (the pointwise derivatives and ``d_gates @ W_hh``), and then
   computes the weight gradients for all steps at once as **one matmul**
   ``d_gates.T @ h_prev``.  Autodiff through the loop would build the weight
   gradient from T small products and is several times slower.  (Seqlib's C++
   loop after an input-side forward is the exception: where the weight gradients
   are small, it adds each step's share while the step's ``d_gates`` are in cache.)

Only a call that a transformation traces (``mx.grad``, ``mx.vjp``, ``mx.compile``: see
:func:`seqlib.pointwise.is_traced`) needs the backward.  Any other call is inference: it
runs the loop alone, one compiled step (:func:`seqlib.pointwise.lstm_step` and its kin)
per time step, and saves nothing.  Both give the same numbers.

Sequences are *packed*: row-major by time step, ``batch_sizes[t]`` rows at step
t, longest sequences first, exactly like :class:`seqlib.nn.utils.rnn.PackedSequence`.
An ordinary (T, B) batch is the special case ``batch_sizes = (B,) * T``.  At step
t only the first ``batch_sizes[t]`` rows of the state are updated; the rest
keep their value, so the final state holds each sequence's own last step (its
first step, going in reverse).  No work is spent on padding.

Where seqlib runs its kernels (on a Mac, or emulated: see :mod:`seqlib.kernels`)
the gate math runs in the fused Metal kernels (one launch per step), and for
small batches a whole layer runs in one launch (``lstm_sequence.metal``,
``gru_sequence.metal``); the backward is the same loop with the backward
kernels.  ``SEQLIB_BACKEND=ops`` forces the MLX-ops path everywhere.

Shapes: N rows in all, B = batch_sizes[0] sequences, H hidden units, P the
size of h (P = H, or ``proj_size`` for a projected LSTM), G gate blocks.

Every public function checks its arguments first (a ValueError or TypeError
naming the argument): arrays of one floating dtype and matching shapes, B and
H at least 1, and ``batch_sizes`` integers (floats are refused, not truncated)
that describe a packed batch: non-increasing, each at least 1, starting at B
and adding up to N.  NaN propagates as in torch (relu and tanh of NaN are NaN).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from seqlib import kernels, native
from seqlib._checks import check_batch_sizes, check_choice, check_float_array, check_state
from seqlib.dispatch import path_for
from seqlib.graph import is_traced
from seqlib.pointwise import (
    gate_path,
    gru_backward_on,
    gru_pointwise_on,
    gru_step,
    lstm_backward_on,
    lstm_pointwise_on,
    lstm_step,
    rnn_activation_backward_on,
    rnn_activation_on,
    rnn_step,
)

__all__ = [
    "batch_first", "gru_input_sequence", "gru_sequence", "lstm_input_sequence", "lstm_sequence", "rnn_sequence",
    "time_major",
]


# ----------------------------------------------------------------- the sequence loop


@functools.lru_cache(maxsize=512)
def _steps(batch_sizes: tuple[int, ...], reverse: bool) -> tuple[tuple[int, int, int], ...]:
    """(t, first row, number of rows) for each step, in the order they are computed."""
    offsets = [0]
    for size in batch_sizes[:-1]:
        offsets.append(offsets[-1] + size)
    steps = tuple(zip(range(len(batch_sizes)), offsets, batch_sizes, strict=True))
    return steps[::-1] if reverse else steps


def _first_rows(state: mx.array, rows: int) -> mx.array:
    """The state of the sequences still running at a step: its first ``rows`` rows."""
    return state if rows == state.shape[0] else state[:rows]


def _update(state: mx.array, new_rows: mx.array) -> mx.array:
    """The state with its first rows replaced; the rest (finished or not yet started sequences) kept."""
    if new_rows.shape[0] == state.shape[0]:
        return new_rows
    return mx.concatenate([new_rows, state[new_rows.shape[0]:]], axis=0)


def _in_time_order(per_step: list) -> mx.array:
    return mx.concatenate(per_step, axis=0) if len(per_step) > 1 else per_step[0]


def _saved(per_kind: list[list]) -> tuple[mx.array, ...]:
    """What the backward needs, one packed (N, ...) array per kind in time order.

    Few outputs, each the size of the sequence, keep building and evaluating the graph
    linear in T: a custom function with an output per step would give every output a
    sibling list of length ~T, and the graph would grow as T squared.
    """
    return tuple(_in_time_order(arrays) for arrays in per_kind)


def _check_input_bias(input_bias, width: int, dtype) -> None:
    if input_bias is not None:
        check_float_array(input_bias, "input_bias", (width,), dtype)


def _biased(x_gates, input_bias):
    """x_gates with input_bias added to every row, for the paths that do not add it in their loop."""
    return x_gates if input_bias is None else x_gates + input_bias


def _use_whole_sequence_kernel(use_kernels: bool, batch: int, hidden_size: int) -> bool:
    return use_kernels and kernels.sequence_kernel_serves(batch, hidden_size)


# ----------------------------------------------------------------- inference: the forward alone
#
# When no transformation traces the arguments (seqlib.graph.is_traced), no gradient can be taken
# through the result: the loops below run one compiled step per time step and save nothing,
# with no custom function around them.  On the "plain" path (seqlib.dispatch) the same loops run
# MLX's built-in ops, uncompiled, traced or not: MLX's autodiff then differentiates them.


def _lstm_inference(x_gates, w_hh, h0, c0, steps, w_hr, plain=False):
    h, c = h0, c0
    outputs = [None] * len(steps)
    for t, first, rows in steps:
        h_new, c_new = lstm_step(x_gates[first:first + rows], _first_rows(h, rows), _first_rows(c, rows), w_hh, plain)
        if w_hr is not None:
            h_new = h_new @ w_hr.T
        outputs[t] = h_new
        h, c = _update(h, h_new), _update(c, c_new)
    return _in_time_order(outputs), h, c


def _gru_inference(x_gates, w_hh, b_hh, h0, steps, plain=False):
    h = h0
    outputs = [None] * len(steps)
    for t, first, rows in steps:
        outputs[t] = gru_step(x_gates[first:first + rows], _first_rows(h, rows), w_hh, b_hh, plain)
        h = _update(h, outputs[t])
    return _in_time_order(outputs), h


def _rnn_inference(x_gates, w_hh, h0, steps, nonlinearity, plain=False):
    h = h0
    outputs = [None] * len(steps)
    for t, first, rows in steps:
        outputs[t] = rnn_step(x_gates[first:first + rows], _first_rows(h, rows), w_hh, nonlinearity, plain)
        h = _update(h, outputs[t])
    return _in_time_order(outputs), h


# ----------------------------------------------------------------- training: a custom function with its backward
#
# The forwards below add the input side and the recurrent product in two ops, where the
# inference loops use one mx.addmm.  They run under transformations, mx.vmap among them, and MLX 0.32's
# AddMM::vmap fails where only c is mapped ("input c must broadcast to the output shape"): the input side
# of a vmapped sequence is mapped, its zero initial state is not.  (The two agree to float32 rounding.)


@functools.lru_cache(maxsize=512)
def _lstm_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, projected: bool, use_kernels: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, h0, c0, *projection):
        # x_gates (N, 4H); w_hh (4H, P); h0 (B, P); c0 (B, H); projection: (w_hr (P, H),) or ()
        if not projected and _use_whole_sequence_kernel(use_kernels, *c0.shape):
            return kernels.lstm_sequence_forward(x_gates, w_hh, h0, c0, batch_sizes, reverse)
        h, c = h0, c0
        path = gate_path(x_gates, use_kernels)
        outputs, activations, tanh_cs, c_prevs, h_prevs = ([None] * num_steps for _ in range(5))
        for t, first, rows in steps:
            h_prev, c_prev = h[:rows], c[:rows]
            gates = x_gates[first:first + rows] + h_prev @ w_hh.T  # not addmm: its vmap fails here
            h_new, c_new, activations[t], tanh_cs[t] = lstm_pointwise_on(path, gates, c_prev)
            if projected:
                h_new = h_new @ projection[0].T
            outputs[t], c_prevs[t], h_prevs[t] = h_new, c_prev, h_prev
            h, c = _update(h, h_new), _update(c, c_new)
        return (_in_time_order(outputs), h, c, *_saved([activations, tanh_cs, c_prevs, h_prevs]))

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh, projection = primals[1], primals[4:]
        d_outputs, d_h, d_c = cotangents[:3]
        activations, tanh_cs, c_prevs, h_prevs = outputs[3:]  # packed (N, 4H), (N, H), (N, H), (N, P)
        d_gates_steps, d_outputs_steps = [None] * num_steps, [None] * num_steps
        path = "kernel" if use_kernels else "ops"
        for t, first, rows in reversed(steps):
            step = slice(first, first + rows)
            d_out = d_outputs[step] + d_h[:rows]
            if projected:
                d_outputs_steps[t] = d_out
                d_out = d_out @ projection[0]
            d_gates, d_c_prev = lstm_backward_on(
                path, d_out, d_c[:rows], activations[step], tanh_cs[step], c_prevs[step]
            )
            d_h, d_c = _update(d_h, d_gates @ w_hh), _update(d_c, d_c_prev)
            d_gates_steps[t] = d_gates
        d_x_gates = _in_time_order(d_gates_steps)
        d_w_hh = d_x_gates.T @ h_prevs  # every step's weight gradient in one matmul
        grads = [d_x_gates, d_w_hh, d_h, d_c]
        if projected:
            hidden_size = tanh_cs.shape[-1]  # h before the projection is o * tanh(c), o the last gate block
            h_unprojected = activations[:, -hidden_size:] * tanh_cs
            grads.append(_in_time_order(d_outputs_steps).T @ h_unprojected)
        return tuple(grads)

    return forward


def _check_lstm_state(w_hh, h0, c0, w_hr, input_bias) -> tuple[int, int]:
    """Check an LSTM's state, recurrent weights and input bias against each other; returns (B, H)."""
    batch, hidden_size = check_state("c0", c0)
    dtype = c0.dtype
    if w_hr is None:
        check_float_array(h0, "h0", (batch, hidden_size), dtype)
    else:
        check_float_array(h0, "h0", (batch, None), dtype)
        check_float_array(w_hr, "w_hr", (h0.shape[1], hidden_size), dtype)
    check_float_array(w_hh, "w_hh", (4 * hidden_size, h0.shape[1]), dtype)
    _check_input_bias(input_bias, 4 * hidden_size, dtype)
    return batch, hidden_size


def _check_input_rows(x, w_ih, gates: int, dtype) -> None:
    """Check an input-side sequence's rows x (N, D) and its w_ih (gates, D)."""
    check_float_array(x, "x", (None, None), dtype)
    check_float_array(w_ih, "w_ih", (gates, x.shape[1]), dtype)


def lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, reverse=False, w_hr=None, *, input_bias=None):
    """Run an LSTM over packed rows; returns ``output (N, P), h_n (B, P), c_n (B, H)``.

    x_gates: (N, 4H) ``x @ W_ih.T`` for all rows, plus ``b_ih + b_hh`` unless they are
    passed as input_bias: (4H,), added to every row; w_hh: (4H, P); h0: (B, P),
    c0: (B, H); batch_sizes: rows per step; w_hr: (P, H) for a projected LSTM
    (``proj_size = P``), else None.
    """
    batch, hidden_size = _check_lstm_state(w_hh, h0, c0, w_hr, input_bias)
    check_float_array(x_gates, "x_gates", (None, 4 * hidden_size), c0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")
    path, reverse = path_for(x_gates.dtype), bool(reverse)
    projection = () if w_hr is None else (w_hr,)
    if path == "native" and w_hr is None:  # the primitive saves what its own vjp needs where traced
        traced = is_traced(x_gates, w_hh, h0, c0, input_bias)
        return tuple(native.extension().lstm_sequence(x_gates, w_hh, h0, c0, list(batch_sizes), reverse, traced,
                                                      input_bias)[:3])
    x_gates = _biased(x_gates, input_bias)
    if path == "plain":
        return _lstm_inference(x_gates, w_hh, h0, c0, _steps(batch_sizes, reverse), w_hr, plain=True)
    traced = is_traced(x_gates, w_hh, h0, c0, *projection)
    if path != "kernels" and not traced:
        return _lstm_inference(x_gates, w_hh, h0, c0, _steps(batch_sizes, reverse), w_hr)
    function = _lstm_sequence_function(batch_sizes, reverse, w_hr is not None, path == "kernels")
    output, h_n, c_n = function(x_gates, w_hh, h0, c0, *projection)[:3]
    return output, h_n, c_n


def lstm_input_sequence(x, w_ih, w_hh, h0, c0, batch_sizes, reverse=False, *, input_bias=None):
    """An LSTM over packed rows of its input: ``lstm_sequence(x @ w_ih.T, w_hh, h0, c0, batch_sizes, reverse,
    input_bias=input_bias)``, the same numbers to float32 rounding; returns ``output (N, H), h_n (B, H), c_n (B, H)``.

    x: (N, D) the input rows; w_ih: (4H, D); the rest as :func:`lstm_sequence`'s (no projection).  Where
    seqlib's C++ loop runs (:mod:`seqlib.native`, on packed weights) and the input is narrow against the
    batch (D <= 8 B with AVX-512, D <= 4 B with AVX2; B = batch_sizes[0]), the loop computes each step's
    input side ``x_t @ w_ih.T`` itself, on the tiles of the recurrent product, instead of reading the
    (N, 4H) ``x_gates`` that one matmul wrote before it; elsewhere this is that matmul and
    :func:`lstm_sequence`.  Where the loop computed the input side and the weight gradients are small
    (4H (D + H) floats in at most 512 KB), its backward loop adds each step's share of ``d_w_ih``, ``d_w_hh``
    and the bias's gradient, and takes ``d_x``'s rows, while the step's gradients are in cache, instead of
    the matmuls over all rows after it.
    """
    batch, hidden_size = _check_lstm_state(w_hh, h0, c0, None, input_bias)
    _check_input_rows(x, w_ih, 4 * hidden_size, c0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x.shape[0], batch, rows_name="x")
    if path_for(c0.dtype) != "native":
        return lstm_sequence(x @ w_ih.T, w_hh, h0, c0, batch_sizes, reverse, input_bias=input_bias)
    traced = is_traced(x, w_ih, w_hh, h0, c0, input_bias)  # the primitive saves what its own vjp needs
    return tuple(native.extension().lstm_input_sequence(x, w_ih, w_hh, h0, c0, list(batch_sizes), bool(reverse),
                                                        traced, input_bias)[:3])


def _check_gru_state(w_hh, b_hh, h0, input_bias) -> tuple[int, int]:
    """Check a GRU's state, hidden-side weights and input bias against each other; returns (B, H)."""
    batch, hidden_size = check_state("h0", h0)
    check_float_array(w_hh, "w_hh", (3 * hidden_size, hidden_size), h0.dtype)
    check_float_array(b_hh, "b_hh", (3 * hidden_size,), h0.dtype)
    _check_input_bias(input_bias, 3 * hidden_size, h0.dtype)
    return batch, hidden_size


@functools.lru_cache(maxsize=512)
def _gru_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, use_kernels: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, b_hh, h0):
        # x_gates (N, 3H) = x @ W_ih.T + b_ih; w_hh (3H, H); b_hh (3H,); h0 (B, H)
        if _use_whole_sequence_kernel(use_kernels, *h0.shape):
            return kernels.gru_sequence_forward(x_gates, w_hh, b_hh, h0, batch_sizes, reverse)
        h = h0
        path = gate_path(x_gates, use_kernels)
        outputs, activations, hidden_sides, h_prevs = ([None] * num_steps for _ in range(4))
        for t, first, rows in steps:
            h_prev = h[:rows]
            hidden_side = mx.addmm(b_hh, h_prev, w_hh.T)
            outputs[t], activations[t] = gru_pointwise_on(path, x_gates[first:first + rows], hidden_side, h_prev)
            hidden_sides[t], h_prevs[t] = hidden_side, h_prev
            h = _update(h, outputs[t])
        return (_in_time_order(outputs), h, *_saved([activations, hidden_sides, h_prevs]))

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh = primals[1]
        d_outputs, d_h = cotangents[:2]
        activations, hidden_sides, h_prevs = outputs[2:]  # packed (N, 3H), (N, 3H), (N, H)
        d_input_steps, d_hidden_steps = [None] * num_steps, [None] * num_steps
        path = "kernel" if use_kernels else "ops"
        for t, first, rows in reversed(steps):
            step = slice(first, first + rows)
            d_out = d_outputs[step] + d_h[:rows]
            d_input_side, d_hidden_side, d_h_direct = gru_backward_on(
                path, d_out, activations[step], hidden_sides[step], h_prevs[step]
            )
            d_h = _update(d_h, mx.addmm(d_h_direct, d_hidden_side, w_hh))
            d_input_steps[t], d_hidden_steps[t] = d_input_side, d_hidden_side
        d_hidden_all = _in_time_order(d_hidden_steps)
        d_w_hh = d_hidden_all.T @ h_prevs
        return _in_time_order(d_input_steps), d_w_hh, d_hidden_all.sum(axis=0), d_h

    return forward


def gru_sequence(x_gates, w_hh, b_hh, h0, batch_sizes, reverse=False, *, input_bias=None):
    """Run a GRU over packed rows; returns ``output (N, H), h_n (B, H)``.

    x_gates: (N, 3H) ``x @ W_ih.T``, plus ``b_ih`` unless it is passed as
    input_bias: (3H,), added to every row; w_hh: (3H, H); b_hh: (3H,) (zeros for a
    layer without bias); h0: (B, H).
    """
    batch, hidden_size = _check_gru_state(w_hh, b_hh, h0, input_bias)
    check_float_array(x_gates, "x_gates", (None, 3 * hidden_size), h0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")
    path, reverse = path_for(h0.dtype), bool(reverse)
    if path == "native":
        traced = is_traced(x_gates, w_hh, b_hh, h0, input_bias)
        return tuple(native.extension().gru_sequence(x_gates, w_hh, b_hh, h0, list(batch_sizes), reverse, traced,
                                                     input_bias)[:2])
    x_gates = _biased(x_gates, input_bias)
    if path == "plain":
        return _gru_inference(x_gates, w_hh, b_hh, h0, _steps(batch_sizes, reverse), plain=True)
    traced = is_traced(x_gates, w_hh, b_hh, h0)
    if path != "kernels" and not traced:
        return _gru_inference(x_gates, w_hh, b_hh, h0, _steps(batch_sizes, reverse))
    function = _gru_sequence_function(batch_sizes, reverse, path == "kernels")
    output, h_n = function(x_gates, w_hh, b_hh, h0)[:2]
    return output, h_n


def gru_input_sequence(x, w_ih, w_hh, b_hh, h0, batch_sizes, reverse=False, *, input_bias=None):
    """A GRU over packed rows of its input: ``gru_sequence(x @ w_ih.T, w_hh, b_hh, h0, batch_sizes, reverse,
    input_bias=input_bias)``, the same numbers to float32 rounding; returns ``output (N, H), h_n (B, H)``.

    x: (N, D) the input rows; w_ih: (3H, D); the rest as :func:`gru_sequence`'s.  Seqlib's C++ loop computes
    each step's input side itself where :func:`lstm_input_sequence`'s does (D <= 8 B with AVX-512, D <= 4 B
    with AVX2), and its backward loop takes the gradients of x, w_ih, w_hh, b_hh and the bias where the
    LSTM's does (3H (D + H) floats in at most 512 KB); elsewhere this is one matmul and :func:`gru_sequence`.
    """
    batch, hidden_size = _check_gru_state(w_hh, b_hh, h0, input_bias)
    _check_input_rows(x, w_ih, 3 * hidden_size, h0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x.shape[0], batch, rows_name="x")
    if path_for(h0.dtype) != "native":
        return gru_sequence(x @ w_ih.T, w_hh, b_hh, h0, batch_sizes, reverse, input_bias=input_bias)
    traced = is_traced(x, w_ih, w_hh, b_hh, h0, input_bias)  # the primitive saves what its own vjp needs
    return tuple(native.extension().gru_input_sequence(x, w_ih, w_hh, b_hh, h0, list(batch_sizes), bool(reverse),
                                                       traced, input_bias)[:2])


@functools.lru_cache(maxsize=512)
def _rnn_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, nonlinearity: str, use_kernels: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, h0):
        # x_gates (N, H) = x @ W_ih.T + b_ih + b_hh; w_hh (H, H); h0 (B, H)
        h = h0
        path = gate_path(x_gates, use_kernels)
        outputs, h_prevs = [None] * num_steps, [None] * num_steps
        for t, first, rows in steps:
            h_prevs[t] = h[:rows]
            pre = x_gates[first:first + rows] + h_prevs[t] @ w_hh.T  # not addmm: its vmap fails here
            outputs[t] = rnn_activation_on(path, nonlinearity, pre)
            h = _update(h, outputs[t])
        return (_in_time_order(outputs), h, *_saved([h_prevs]))

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh = primals[1]
        d_outputs, d_h = cotangents[:2]
        output, h_prevs = outputs[0], outputs[2]  # packed (N, H) each
        d_pre_steps = [None] * num_steps
        path = "kernel" if use_kernels else "ops"
        for t, first, rows in reversed(steps):
            d_out = d_outputs[first:first + rows] + d_h[:rows]
            d_pre_steps[t] = rnn_activation_backward_on(path, nonlinearity, d_out, output[first:first + rows])
            d_h = _update(d_h, d_pre_steps[t] @ w_hh)
        d_x_gates = _in_time_order(d_pre_steps)
        return d_x_gates, d_x_gates.T @ h_prevs, d_h

    return forward


def rnn_sequence(x_gates, w_hh, h0, batch_sizes, reverse=False, nonlinearity="tanh", *, input_bias=None):
    """Run an Elman RNN over packed rows; returns ``output (N, H), h_n (B, H)``.

    x_gates: (N, H) ``x @ W_ih.T``, plus ``b_ih + b_hh`` unless they are passed as
    input_bias: (H,), added to every row; w_hh: (H, H); h0: (B, H).
    """
    check_choice("nonlinearity", nonlinearity, kernels.NONLINEARITIES)
    batch, hidden_size = check_state("h0", h0)
    check_float_array(x_gates, "x_gates", (None, hidden_size), h0.dtype)
    check_float_array(w_hh, "w_hh", (hidden_size, hidden_size), h0.dtype)
    _check_input_bias(input_bias, hidden_size, h0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")
    path, reverse = path_for(h0.dtype), bool(reverse)
    if path == "native":
        traced = is_traced(x_gates, w_hh, h0, input_bias)
        return tuple(native.extension().rnn_sequence(x_gates, w_hh, h0, list(batch_sizes), reverse,
                                                     nonlinearity == "relu", traced, input_bias)[:2])
    x_gates = _biased(x_gates, input_bias)
    if path == "plain":
        return _rnn_inference(x_gates, w_hh, h0, _steps(batch_sizes, reverse), nonlinearity, plain=True)
    traced = is_traced(x_gates, w_hh, h0)
    if path != "kernels" and not traced:
        return _rnn_inference(x_gates, w_hh, h0, _steps(batch_sizes, reverse), nonlinearity)
    function = _rnn_sequence_function(batch_sizes, reverse, nonlinearity, path == "kernels")
    output, h_n = function(x_gates, w_hh, h0)[:2]
    return output, h_n


# ----------------------------------------------------------------- a batch-first input


def time_major(batch_first: mx.array) -> mx.array:
    """A batch-first sequence ``(B, T, *)`` as time-major ``(T, B, *)``: ``batch_first.swapaxes(0, 1)``.

    Where :mod:`seqlib.dispatch` picks the C++ primitives, a row-contiguous copy made on several threads
    (MLX copies a swapaxes view on one: 0.65 ms of the LSTM's 11 ms forward at (B, T, D) = (32, 100, 256)
    on 16 cores), whose gradient is the cotangent's view swapped back, as MLX's; elsewhere the view (which
    the layers' reshape into rows then copies).  Same values either way, bit for bit.
    """
    if path_for(batch_first.dtype) == "native":
        return native.extension().swap_leading_axes(batch_first)
    return batch_first.swapaxes(0, 1)


def batch_first(time_major: mx.array) -> mx.array:
    """A time-major sequence ``(T, B, *)`` as batch-first ``(B, T, *)``: the view ``time_major.swapaxes(0, 1)``.

    Where :mod:`seqlib.dispatch` picks the C++ primitives, its gradient is a row-contiguous copy of the cotangent
    swapped back, made on several threads (``SwappedView``'s, by ``SwapLeadingAxes``), where MLX's is a view that a
    backward loop, which reads whole rows, then has MLX copy on one thread.  Same values either way, bit for bit.
    """
    if path_for(time_major.dtype) == "native":
        return native.extension().swapped_view(time_major)
    return time_major.swapaxes(0, 1)
