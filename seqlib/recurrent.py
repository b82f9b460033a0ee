"""One recurrent layer, one direction, over a whole sequence: the fast CPU path, with its own backward.

The layers in :mod:`seqlib.nn` (and the cells, which are sequences of length
one) all end here.  The structure is the one fast implementations share
(Appleyard et al. 2016, cuDNN):

1. The input side of every gate, for every time step, is **one matmul** done by
   the caller: ``x_gates = x @ W_ih.T + b`` with x all ``N`` rows of the sequence.
2. Each step then needs only the recurrent matmul ``h @ W_hh.T`` and the
   **fused pointwise gate math** (one compiled function, built on the
   rational ``tanh`` of :mod:`seqlib.activations`).
3. The backward is written by hand (backpropagation through time, as in
   :mod:`seqlib.reference`): it walks the steps in reverse doing only what must
   be sequential (the pointwise derivatives and ``d_gates @ W_hh``), and then
   computes the weight gradients for all steps at once as **one matmul**
   ``d_gates.T @ h_prev``.  Autodiff through the loop would build the weight
   gradient from T small products and is several times slower.

Sequences are *packed*: row-major by time step, ``batch_sizes[t]`` rows at step
t, longest sequences first, exactly like :class:`seqlib.nn.utils.rnn.PackedSequence`.
An ordinary (T, B) batch is the special case ``batch_sizes = (B,) * T``.  At step
t only the first ``batch_sizes[t]`` rows of the state are updated; the rest
keep their value, so the final state holds each sequence's own last step (its
first step, going in reverse).  No work is spent on padding.

On a Mac the gate math runs in seqlib's fused Metal kernels instead (one launch
per step, see :mod:`seqlib.kernels`), and for small batches a whole layer runs
in one launch (``lstm_sequence.metal``, ``gru_sequence.metal``); the backward
is the same loop with the backward kernels.  ``SEQLIB_BACKEND=ops`` forces
this file's MLX-ops path everywhere.

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
import platform
import shutil

import mlx.core as mx

from seqlib import kernels
from seqlib._checks import check_batch_sizes, check_choice, check_float_array
from seqlib.activations import fast_tanh

__all__ = ["gru_pointwise", "gru_sequence", "lstm_pointwise", "lstm_sequence", "rnn_sequence"]


def _compile(function):
    """``mx.compile`` where it can run: on Linux the CPU backend needs a C++ compiler at run time."""
    if platform.system() == "Linux" and shutil.which("g++") is None:
        return function
    return mx.compile(function)


# ----------------------------------------------------------------- pointwise gate math
#
# Each gate function is written once, for a given ``tanh``, in two builds:
# compiled, with the rational tanh of seqlib.activations (fused into a few
# vectorised loops); and eager, with ``mx.tanh``.  The eager build is for calls
# under ``mx.grad``/``mx.vjp``: there MLX does not compile (its inputs are
# tracers, and ``mx.compile`` then just calls the Python function), and one
# ``mx.tanh`` beats the dozen separate ops of an uncompiled rational.


_compiled_traces = 0


def _count_trace(x):
    global _compiled_traces
    _compiled_traces += 1
    return x


_trace_probe = _compile(_count_trace)
for _dtype in (mx.float32, mx.float16, mx.bfloat16):  # trace the probe once now, not on a user's first call
    _trace_probe(mx.zeros((1,), _dtype))


def _compiles_here(x: mx.array) -> bool:
    """Whether a compiled function called with ``x`` runs compiled: it re-traces (runs its Python body)
    on every call only while ``x`` is being traced by a transformation, or when compiling is off."""
    before = _compiled_traces
    _trace_probe(x.reshape(-1)[:1])  # a fixed shape: the probe itself is traced once per dtype
    return _compiled_traces == before


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


def _gate_path(x: mx.array) -> str:
    """Where a step's gate math runs: "metal" (seqlib's kernels), "compiled" or "eager" (MLX ops)."""
    if kernels.backend() == "metal":
        return "metal"
    return "compiled" if _compiles_here(x) else "eager"


def _path(compiled: bool | None, x: mx.array) -> str:
    if compiled is None:
        return _gate_path(x)
    return "compiled" if compiled else "eager"


def lstm_pointwise(gates: mx.array, c_prev: mx.array, compiled: bool | None = None):
    """The LSTM's gate math for one step.

    gates: (B, 4H) pre-activations in the order i, f, g, o; c_prev: (B, H), B and H at least 1,
    both of one floating dtype.  Returns ``h (B, H), c (B, H), activations (B, 4H), tanh_c (B, H)``;
    the last two are what the backward needs.  ``compiled``: which MLX-ops build to
    run (None: the Metal kernel where the backend is "metal", else ask
    :func:`_compiles_here`; the sequence loops decide once per sequence).
    NaN in, NaN out, as torch's sigmoid and tanh.
    """
    batch, hidden_size = _check_state("c_prev", c_prev)
    check_float_array(gates, "gates", (batch, 4 * hidden_size), c_prev.dtype)
    return _lstm_pointwise_on(_path(compiled, gates), gates, c_prev)


def _check_state(name: str, state) -> tuple[int, int]:
    """A (B, H) state with B, H >= 1: returns its shape."""
    check_float_array(state, name, (None, None))
    if state.size == 0:
        raise ValueError(f"{name}: expected a non-empty (batch, hidden_size) array, got shape {tuple(state.shape)}")
    return state.shape


def _lstm_pointwise_on(path: str, gates, c_prev):
    if path == "metal":
        return kernels.lstm_cell(gates, c_prev)
    scale, shift = _lstm_activation_constants(c_prev.shape[-1], gates.dtype)
    if path == "compiled":
        return _lstm_pointwise_compiled(gates, c_prev, scale, shift)
    return _lstm_pointwise(mx.tanh, gates, c_prev, scale, shift)


def _lstm_backward_on(path: str, d_h, d_c, activations, tanh_c, c_prev):
    if path == "metal":
        return kernels.lstm_cell_backward(d_h, d_c, activations, tanh_c, c_prev)
    return _lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev)


def lstm_pointwise_backward(d_h, d_c, activations, tanh_c, c_prev):
    """Gradients through one step's gate math: returns ``d_gates (B, 4H), d_c_prev (B, H)``.

    d_h, d_c: the gradients arriving at this step's h and c (B, H); activations (B, 4H) and
    tanh_c (B, H) as :func:`lstm_pointwise` returned them; c_prev (B, H)."""
    batch, hidden_size = _check_state("c_prev", c_prev)
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


def gru_pointwise(input_side: mx.array, hidden_side: mx.array, h_prev: mx.array, compiled: bool | None = None):
    """The GRU's gate math for one step, with PyTorch's ``n = tanh(i_n + r * (W_hn h + b_hn))``.

    input_side: (B, 3H) ``W_ih x + b_ih``; hidden_side: (B, 3H) ``W_hh h + b_hh``; h_prev: (B, H).
    Returns ``h (B, H), activations (B, 3H)`` with activations r, z, n; ``compiled`` as in
    :func:`lstm_pointwise`.
    """
    batch, hidden_size = _check_state("h_prev", h_prev)
    check_float_array(input_side, "input_side", (batch, 3 * hidden_size), h_prev.dtype)
    check_float_array(hidden_side, "hidden_side", (batch, 3 * hidden_size), h_prev.dtype)
    return _gru_pointwise_on(_path(compiled, input_side), input_side, hidden_side, h_prev)


def _gru_pointwise_on(path: str, input_side, hidden_side, h_prev):
    if path == "metal":
        return kernels.gru_cell(input_side, hidden_side, h_prev)
    if path == "compiled":
        return _gru_pointwise_compiled(input_side, hidden_side, h_prev)
    return _gru_pointwise(mx.tanh, input_side, hidden_side, h_prev)


def _gru_backward_on(path: str, d_h, activations, hidden_side, h_prev):
    if path == "metal":
        return kernels.gru_cell_backward(d_h, activations, hidden_side, h_prev)
    return _gru_pointwise_backward(d_h, activations, hidden_side, h_prev)


def gru_pointwise_backward(d_h, activations, hidden_side, h_prev):
    """Returns ``d_input_side (B, 3H), d_hidden_side (B, 3H), d_h_prev`` (the direct part, without W_hh).

    d_h, h_prev: (B, H); activations (B, 3H) as :func:`gru_pointwise` returned them; hidden_side (B, 3H)."""
    batch, hidden_size = _check_state("h_prev", h_prev)
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


def _rnn_activation_on(path: str, nonlinearity: str, x: mx.array) -> mx.array:
    if path == "metal":
        return kernels.rnn_cell(x, nonlinearity)
    if nonlinearity == "relu":
        return mx.maximum(x, 0)  # propagates NaN, as torch's relu
    return _fast_tanh_compiled(x) if path == "compiled" else mx.tanh(x)


@_compile
def _tanh_backward(d_h, h):
    return d_h * (1 - h * h)


def _rnn_activation_backward_on(path: str, nonlinearity: str, d_h, h):
    if path == "metal":
        return kernels.rnn_cell_backward(d_h, h, nonlinearity)
    if nonlinearity == "tanh":
        return _tanh_backward(d_h, h)
    return mx.where(h <= 0, 0, d_h)  # torch's threshold_backward: a NaN output passes its gradient on


# ----------------------------------------------------------------- the sequence loop


def _steps(batch_sizes: tuple[int, ...], reverse: bool):
    """(t, first row, number of rows) for each step, in the order they are computed."""
    offsets = [0]
    for size in batch_sizes[:-1]:
        offsets.append(offsets[-1] + size)
    steps = list(zip(range(len(batch_sizes)), offsets, batch_sizes, strict=True))
    return steps[::-1] if reverse else steps


def _update(state: mx.array, new_rows: mx.array) -> mx.array:
    """The state with its first rows replaced; the rest (finished or not yet started sequences) kept."""
    if new_rows.shape[0] == state.shape[0]:
        return new_rows
    return mx.concatenate([new_rows, state[new_rows.shape[0]:]], axis=0)


def _in_time_order(per_step: list) -> mx.array:
    return mx.concatenate(per_step, axis=0) if len(per_step) > 1 else per_step[0]


def _by_step(rows: mx.array, steps) -> list[mx.array]:
    """Packed (N, ...) rows -> one block per time step, in time order (undoes _in_time_order)."""
    return [rows[first:first + count] for _, first, count in sorted(steps)]


def _loop_path(metal: bool, x: mx.array) -> str:
    """The gate-math path of a whole sequence, decided once."""
    if metal:
        return "metal"
    return "compiled" if _compiles_here(x) else "eager"


def _use_whole_sequence_kernel(metal: bool, batch: int, hidden_size: int) -> bool:
    return metal and kernels.sequence_kernel_serves(batch, hidden_size)


@functools.lru_cache(maxsize=512)
def _lstm_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, projected: bool, metal: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, h0, c0, *projection):
        # x_gates (N, 4H); w_hh (4H, P); h0 (B, P); c0 (B, H); projection: (w_hr (P, H),) or ()
        if not projected and _use_whole_sequence_kernel(metal, *c0.shape):
            output, h_n, c_n, *saved = kernels.lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, reverse)
            return (output, h_n, c_n, *(block for rows in saved for block in _by_step(rows, steps)))
        h, c = h0, c0
        path = _loop_path(metal, x_gates)
        outputs, activations, tanh_cs, c_prevs, h_prevs = ([None] * num_steps for _ in range(5))
        for t, first, rows in steps:
            h_prev, c_prev = h[:rows], c[:rows]
            gates = mx.addmm(x_gates[first:first + rows], h_prev, w_hh.T)
            h_new, c_new, activations[t], tanh_cs[t] = _lstm_pointwise_on(path, gates, c_prev)
            if projected:
                h_new = h_new @ projection[0].T
            outputs[t], c_prevs[t], h_prevs[t] = h_new, c_prev, h_prev
            h, c = _update(h, h_new), _update(c, c_new)
        return (_in_time_order(outputs), h, c, *activations, *tanh_cs, *c_prevs, *h_prevs)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh, projection = primals[1], primals[4:]
        d_outputs, d_h, d_c = cotangents[:3]
        saved = outputs[3:]
        activations, tanh_cs = saved[:num_steps], saved[num_steps:2 * num_steps]
        c_prevs, h_prevs = saved[2 * num_steps:3 * num_steps], saved[3 * num_steps:]
        d_gates_steps, d_outputs_steps = [None] * num_steps, [None] * num_steps
        path = "metal" if metal else "ops"
        for t, first, rows in reversed(steps):
            d_out = d_outputs[first:first + rows] + d_h[:rows]
            if projected:
                d_outputs_steps[t] = d_out
                d_out = d_out @ projection[0]
            d_gates, d_c_prev = _lstm_backward_on(path, d_out, d_c[:rows], activations[t], tanh_cs[t], c_prevs[t])
            d_h, d_c = _update(d_h, d_gates @ w_hh), _update(d_c, d_c_prev)
            d_gates_steps[t] = d_gates
        d_x_gates = _in_time_order(d_gates_steps)
        d_w_hh = d_x_gates.T @ _in_time_order(list(h_prevs))  # every step's weight gradient in one matmul
        grads = [d_x_gates, d_w_hh, d_h, d_c]
        if projected:
            hidden_size = tanh_cs[0].shape[-1]  # h before the projection is o * tanh(c), o the last gate block
            h_unprojected = [a[:, -hidden_size:] * tanh_c for a, tanh_c in zip(activations, tanh_cs, strict=True)]
            grads.append(_in_time_order(d_outputs_steps).T @ _in_time_order(h_unprojected))
        return tuple(grads)

    return forward


def _check_lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, w_hr) -> tuple[int, ...]:
    """Check lstm_sequence's arguments against each other; returns the batch sizes as a tuple."""
    batch, hidden_size = _check_state("c0", c0)
    dtype = c0.dtype
    if w_hr is None:
        check_float_array(h0, "h0", (batch, hidden_size), dtype)
    else:
        check_float_array(h0, "h0", (batch, None), dtype)
        check_float_array(w_hr, "w_hr", (h0.shape[1], hidden_size), dtype)
    check_float_array(x_gates, "x_gates", (None, 4 * hidden_size), dtype)
    check_float_array(w_hh, "w_hh", (4 * hidden_size, h0.shape[1]), dtype)
    return check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")


def lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, reverse=False, w_hr=None):
    """Run an LSTM over packed rows; returns ``output (N, P), h_n (B, P), c_n (B, H)``.

    x_gates: (N, 4H) ``x @ W_ih.T + b_ih + b_hh`` for all rows; w_hh: (4H, P);
    h0: (B, P), c0: (B, H); batch_sizes: rows per step; w_hr: (P, H) for a
    projected LSTM (``proj_size = P``), else None.
    """
    batch_sizes = _check_lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, w_hr)
    metal = kernels.backend() == "metal"
    function = _lstm_sequence_function(batch_sizes, bool(reverse), w_hr is not None, metal)
    projection = () if w_hr is None else (w_hr,)
    output, h_n, c_n = function(x_gates, w_hh, h0, c0, *projection)[:3]
    return output, h_n, c_n


@functools.lru_cache(maxsize=512)
def _gru_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, metal: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, b_hh, h0):
        # x_gates (N, 3H) = x @ W_ih.T + b_ih; w_hh (3H, H); b_hh (3H,); h0 (B, H)
        if _use_whole_sequence_kernel(metal, *h0.shape):
            output, h_n, *saved = kernels.gru_sequence(x_gates, w_hh, b_hh, h0, batch_sizes, reverse)
            return (output, h_n, *(block for rows in saved for block in _by_step(rows, steps)))
        h = h0
        path = _loop_path(metal, x_gates)
        outputs, activations, hidden_sides, h_prevs = ([None] * num_steps for _ in range(4))
        for t, first, rows in steps:
            h_prev = h[:rows]
            hidden_side = mx.addmm(b_hh, h_prev, w_hh.T)
            outputs[t], activations[t] = _gru_pointwise_on(path, x_gates[first:first + rows], hidden_side, h_prev)
            hidden_sides[t], h_prevs[t] = hidden_side, h_prev
            h = _update(h, outputs[t])
        return (_in_time_order(outputs), h, *activations, *hidden_sides, *h_prevs)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh = primals[1]
        d_outputs, d_h = cotangents[:2]
        saved = outputs[2:]
        activations, hidden_sides, h_prevs = saved[:num_steps], saved[num_steps:2 * num_steps], saved[2 * num_steps:]
        d_input_steps, d_hidden_steps = [None] * num_steps, [None] * num_steps
        path = "metal" if metal else "ops"
        for t, first, rows in reversed(steps):
            d_out = d_outputs[first:first + rows] + d_h[:rows]
            d_input_side, d_hidden_side, d_h_direct = _gru_backward_on(
                path, d_out, activations[t], hidden_sides[t], h_prevs[t]
            )
            d_h = _update(d_h, mx.addmm(d_h_direct, d_hidden_side, w_hh))
            d_input_steps[t], d_hidden_steps[t] = d_input_side, d_hidden_side
        d_hidden_all = _in_time_order(d_hidden_steps)
        d_w_hh = d_hidden_all.T @ _in_time_order(list(h_prevs))
        return _in_time_order(d_input_steps), d_w_hh, d_hidden_all.sum(axis=0), d_h

    return forward


def gru_sequence(x_gates, w_hh, b_hh, h0, batch_sizes, reverse=False):
    """Run a GRU over packed rows; returns ``output (N, H), h_n (B, H)``.

    x_gates: (N, 3H) ``x @ W_ih.T + b_ih``; w_hh: (3H, H); b_hh: (3H,) (zeros
    for a layer without bias); h0: (B, H).
    """
    batch, hidden_size = _check_state("h0", h0)
    check_float_array(x_gates, "x_gates", (None, 3 * hidden_size), h0.dtype)
    check_float_array(w_hh, "w_hh", (3 * hidden_size, hidden_size), h0.dtype)
    check_float_array(b_hh, "b_hh", (3 * hidden_size,), h0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")
    function = _gru_sequence_function(batch_sizes, bool(reverse), kernels.backend() == "metal")
    output, h_n = function(x_gates, w_hh, b_hh, h0)[:2]
    return output, h_n


@functools.lru_cache(maxsize=512)
def _rnn_sequence_function(batch_sizes: tuple[int, ...], reverse: bool, nonlinearity: str, metal: bool):
    steps = _steps(batch_sizes, reverse)
    num_steps = len(steps)

    @mx.custom_function
    def forward(x_gates, w_hh, h0):
        # x_gates (N, H) = x @ W_ih.T + b_ih + b_hh; w_hh (H, H); h0 (B, H)
        h = h0
        path = _loop_path(metal, x_gates)
        outputs, h_prevs = [None] * num_steps, [None] * num_steps
        for t, first, rows in steps:
            h_prevs[t] = h[:rows]
            pre = mx.addmm(x_gates[first:first + rows], h_prevs[t], w_hh.T)
            outputs[t] = _rnn_activation_on(path, nonlinearity, pre)
            h = _update(h, outputs[t])
        return (_in_time_order(outputs), h, *h_prevs)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        w_hh = primals[1]
        d_outputs, d_h = cotangents[:2]
        output, h_prevs = outputs[0], outputs[2:]
        d_pre_steps = [None] * num_steps
        path = "metal" if metal else "ops"
        for t, first, rows in reversed(steps):
            d_out = d_outputs[first:first + rows] + d_h[:rows]
            d_pre_steps[t] = _rnn_activation_backward_on(path, nonlinearity, d_out, output[first:first + rows])
            d_h = _update(d_h, d_pre_steps[t] @ w_hh)
        d_x_gates = _in_time_order(d_pre_steps)
        return d_x_gates, d_x_gates.T @ _in_time_order(list(h_prevs)), d_h

    return forward


def rnn_sequence(x_gates, w_hh, h0, batch_sizes, reverse=False, nonlinearity="tanh"):
    """Run an Elman RNN over packed rows; returns ``output (N, H), h_n (B, H)``.

    x_gates: (N, H) ``x @ W_ih.T + b_ih + b_hh``; w_hh: (H, H); h0: (B, H).
    """
    check_choice("nonlinearity", nonlinearity, kernels.NONLINEARITIES)
    batch, hidden_size = _check_state("h0", h0)
    check_float_array(x_gates, "x_gates", (None, hidden_size), h0.dtype)
    check_float_array(w_hh, "w_hh", (hidden_size, hidden_size), h0.dtype)
    batch_sizes = check_batch_sizes(batch_sizes, x_gates.shape[0], batch, rows_name="x_gates")
    metal = kernels.backend() == "metal"
    function = _rnn_sequence_function(batch_sizes, bool(reverse), nonlinearity, metal)
    output, h_n = function(x_gates, w_hh, h0)[:2]
    return output, h_n
