"""Reference recurrent cells, written to be read: the book's first versions of RNN, LSTM and GRU.

Three levels, each checked against the next (and against PyTorch) in the tests:

1. *Scalar* cells: one hidden unit and one input feature, plain Python floats,
   every multiplication visible.  Weights are given in PyTorch's packed order,
   one float per gate: ``(i, f, g, o)`` for the LSTM, ``(r, z, n)`` for the GRU.
2. *Vector* cells in NumPy with PyTorch's packed weights: ``weight_ih`` (G*H, D),
   ``weight_hh`` (G*H, H), ``bias_ih`` and ``bias_hh`` (G*H,), for a batch
   ``x`` (B, D) and state ``h`` (B, H).  One matmul per side gives all gates at
   once; slicing the result into G blocks of H columns separates them.
3. *Backpropagation through time by hand*: a forward over T steps that keeps
   what the backward needs, and the backward that walks the steps in reverse.

PyTorch's equations (``*`` is elementwise, ``σ`` the logistic sigmoid):

    RNN   h' = tanh(W_ih x + b_ih + W_hh h + b_hh)          (or relu)
    LSTM  i, f, g, o = σ(.), σ(.), tanh(.), σ(.) of  W_ih x + b_ih + W_hh h + b_hh
          c' = f * c + i * g          h' = o * tanh(c')
    GRU   r, z = σ(.) of the first two blocks of  W_ih x + b_ih + W_hh h + b_hh
          n = tanh(W_in x + b_in + r * (W_hn h + b_hn))      h' = (1 - z) * n + z * h
"""

from __future__ import annotations

import math

import numpy as np

from seqlib._checks import check_choice

__all__ = [
    "gru_backward", "gru_cell", "gru_cell_scalar", "gru_forward",
    "lstm_backward", "lstm_cell", "lstm_cell_scalar", "lstm_forward", "lstm_gates_scalar",
    "rnn_backward", "rnn_cell", "rnn_cell_scalar", "rnn_forward",
]  # fmt: skip


# ---------------------------------------------------------------- 1. scalar cells


def sigmoid_scalar(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def rnn_cell_scalar(x, h, w_ih, w_hh, b_ih, b_hh, nonlinearity="tanh"):
    """One step of a one-unit RNN: every argument is a float."""
    check_choice("nonlinearity", nonlinearity, ("tanh", "relu"))
    a = w_ih * x + b_ih + w_hh * h + b_hh
    return math.tanh(a) if nonlinearity == "tanh" else max(a, 0.0)


def lstm_gates_scalar(x, h, w_ih, w_hh, b_ih, b_hh):
    """The four gates of a one-unit LSTM step, ``(i, f, g, o)``.  ``w_ih`` etc. hold four floats in that order."""
    pre = [w_ih[k] * x + b_ih[k] + w_hh[k] * h + b_hh[k] for k in range(4)]
    i = sigmoid_scalar(pre[0])  # input gate: how much of the candidate to write
    f = sigmoid_scalar(pre[1])  # forget gate: how much of the old cell to keep
    g = math.tanh(pre[2])  # candidate value, in (-1, 1)
    o = sigmoid_scalar(pre[3])  # output gate: how much of the cell to show
    return i, f, g, o


def lstm_cell_scalar(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """One step of a one-unit LSTM.  ``w_ih`` etc. hold four floats, gates in the order i, f, g, o."""
    i, f, g, o = lstm_gates_scalar(x, h, w_ih, w_hh, b_ih, b_hh)
    c_new = f * c + i * g
    h_new = o * math.tanh(c_new)
    return h_new, c_new


def gru_cell_scalar(x, h, w_ih, w_hh, b_ih, b_hh):
    """One step of a one-unit GRU.  ``w_ih`` etc. hold three floats, gates in the order r, z, n."""
    r = sigmoid_scalar(w_ih[0] * x + b_ih[0] + w_hh[0] * h + b_hh[0])  # reset gate
    z = sigmoid_scalar(w_ih[1] * x + b_ih[1] + w_hh[1] * h + b_hh[1])  # update gate
    n = math.tanh(w_ih[2] * x + b_ih[2] + r * (w_hh[2] * h + b_hh[2]))  # candidate: r inside, as in torch
    return (1 - z) * n + z * h


# ---------------------------------------------------------------- 2. vector cells


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _check_cell_shapes(x, h, weight_ih, weight_hh, bias_ih, bias_hh) -> None:
    """Raise a ValueError naming the first argument that does not fit torch's layout: NumPy would
    broadcast a wrong bias or state silently, or fail without saying which argument is wrong."""
    if np.ndim(weight_hh) != 2 or np.ndim(weight_ih) != 2:
        raise ValueError(
            "weight_ih, weight_hh: expected 2-D arrays (G*H, D) and (G*H, H), "
            f"got shapes {np.shape(weight_ih)} and {np.shape(weight_hh)}"
        )
    rows, hidden = np.shape(weight_hh)
    inputs = np.shape(weight_ih)[1]
    batch = np.shape(x)[0] if np.ndim(x) == 2 else "B"
    expected = {"weight_ih": (rows, inputs), "bias_ih": (rows,), "bias_hh": (rows,), "x": (batch, inputs),
                "h": (batch, hidden)}  # fmt: skip
    for name, value in zip(expected, (weight_ih, bias_ih, bias_hh, x, h), strict=True):
        if np.shape(value) != expected[name]:
            raise ValueError(f"{name}: expected shape {expected[name]}, got {np.shape(value)}")


def _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh):
    """The input side and the hidden side of every gate's pre-activation: two (B, G*H) arrays."""
    _check_cell_shapes(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
    return x @ weight_ih.T + bias_ih, h @ weight_hh.T + bias_hh


def rnn_cell(x, h, weight_ih, weight_hh, bias_ih, bias_hh, nonlinearity="tanh"):
    """x (B, D), h (B, H) -> h' (B, H)."""
    check_choice("nonlinearity", nonlinearity, ("tanh", "relu"))
    gi, gh = _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
    return np.tanh(gi + gh) if nonlinearity == "tanh" else np.maximum(gi + gh, 0.0)


def lstm_cell(x, h, c, weight_ih, weight_hh, bias_ih, bias_hh):
    """x (B, D), h and c (B, H) -> h', c' (B, H), with one matmul per side for all four gates."""
    gi, gh = _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
    i, f, g, o = np.split(gi + gh, 4, axis=1)  # (B, H) each, in torch's order
    c_new = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    h_new = sigmoid(o) * np.tanh(c_new)
    return h_new, c_new


def gru_cell(x, h, weight_ih, weight_hh, bias_ih, bias_hh):
    """x (B, D), h (B, H) -> h' (B, H).  The hidden side of n is kept apart: r multiplies it."""
    gi, gh = _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
    i_r, i_z, i_n = np.split(gi, 3, axis=1)
    h_r, h_z, h_n = np.split(gh, 3, axis=1)
    r, z = sigmoid(i_r + h_r), sigmoid(i_z + h_z)
    n = np.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


# ---------------------------------------------------------------- 3. BPTT by hand


def _zero_grads(weight_ih, weight_hh, bias_ih, bias_hh):
    return {"weight_ih": np.zeros_like(weight_ih), "weight_hh": np.zeros_like(weight_hh),
            "bias_ih": np.zeros_like(bias_ih), "bias_hh": np.zeros_like(bias_hh)}  # fmt: skip


def _accumulate(grads, d_gi, d_gh, x, h_prev):
    """Add one step's parameter gradients, given the gradients of its two pre-activation blocks."""
    grads["weight_ih"] += d_gi.T @ x
    grads["bias_ih"] += d_gi.sum(axis=0)
    grads["weight_hh"] += d_gh.T @ h_prev
    grads["bias_hh"] += d_gh.sum(axis=0)


def rnn_forward(xs, h0, weight_ih, weight_hh, bias_ih, bias_hh, nonlinearity="tanh"):
    """xs (T, B, D), h0 (B, H) -> hs (T, B, H) and the cache for :func:`rnn_backward`."""
    hs, h = [], h0
    for x in xs:
        h = rnn_cell(x, h, weight_ih, weight_hh, bias_ih, bias_hh, nonlinearity)
        hs.append(h)
    cache = (xs, h0, np.stack(hs), (weight_ih, weight_hh, bias_ih, bias_hh), nonlinearity)
    return np.stack(hs), cache


def rnn_backward(d_hs, cache):
    """d_hs (T, B, H): the loss gradient of every output.  Returns parameter, input and h0 gradients."""
    xs, h0, hs, params, nonlinearity = cache
    weight_ih, weight_hh, _, _ = params
    grads, d_xs = _zero_grads(*params), np.zeros_like(xs)
    d_h = np.zeros_like(h0)  # gradient arriving from the step after
    for t in reversed(range(len(xs))):
        h_prev = hs[t - 1] if t > 0 else h0
        d_h = d_h + d_hs[t]
        d_a = d_h * (1 - hs[t] ** 2) if nonlinearity == "tanh" else d_h * (hs[t] > 0)
        _accumulate(grads, d_a, d_a, xs[t], h_prev)
        d_xs[t] = d_a @ weight_ih
        d_h = d_a @ weight_hh
    return grads, d_xs, d_h


def lstm_forward(xs, h0, c0, weight_ih, weight_hh, bias_ih, bias_hh):
    """xs (T, B, D), h0 and c0 (B, H) -> hs (T, B, H), c_T, and the cache for :func:`lstm_backward`."""
    hs, cs, gates, h, c = [], [], [], h0, c0
    for x in xs:
        gi, gh = _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
        i, f, g, o = np.split(gi + gh, 4, axis=1)
        i, f, g, o = sigmoid(i), sigmoid(f), np.tanh(g), sigmoid(o)
        c = f * c + i * g
        h = o * np.tanh(c)
        hs.append(h), cs.append(c), gates.append((i, f, g, o))
    cache = (xs, h0, c0, np.stack(hs), np.stack(cs), gates, (weight_ih, weight_hh, bias_ih, bias_hh))
    return np.stack(hs), c, cache


def lstm_backward(d_hs, cache, d_c_last=None):
    """Gradients of all parameters, of xs, h0 and c0, from d_hs (T, B, H) and the final cell's d_c."""
    xs, h0, c0, hs, cs, gates, params = cache
    weight_ih, weight_hh, _, _ = params
    grads, d_xs = _zero_grads(*params), np.zeros_like(xs)
    d_h = np.zeros_like(h0)
    d_c = np.zeros_like(c0) if d_c_last is None else d_c_last
    for t in reversed(range(len(xs))):
        i, f, g, o = gates[t]
        h_prev = hs[t - 1] if t > 0 else h0
        c_prev = cs[t - 1] if t > 0 else c0
        d_h = d_h + d_hs[t]
        tanh_c = np.tanh(cs[t])
        d_o = d_h * tanh_c
        d_c = d_c + d_h * o * (1 - tanh_c**2)  # the cell's gradient: the highway through time
        d_i, d_f, d_g = d_c * g, d_c * c_prev, d_c * i
        d_gates = np.concatenate(  # back through the nonlinearities to the pre-activations (B, 4H)
            [d_i * i * (1 - i), d_f * f * (1 - f), d_g * (1 - g**2), d_o * o * (1 - o)], axis=1
        )
        _accumulate(grads, d_gates, d_gates, xs[t], h_prev)
        d_xs[t] = d_gates @ weight_ih
        d_h = d_gates @ weight_hh
        d_c = d_c * f  # only the forget gate stands between c_{t-1} and c_t
    return grads, d_xs, d_h, d_c


def gru_forward(xs, h0, weight_ih, weight_hh, bias_ih, bias_hh):
    """xs (T, B, D), h0 (B, H) -> hs (T, B, H) and the cache for :func:`gru_backward`."""
    hs, steps, h = [], [], h0
    for x in xs:
        gi, gh = _gate_blocks(x, h, weight_ih, weight_hh, bias_ih, bias_hh)
        i_r, i_z, i_n = np.split(gi, 3, axis=1)
        h_r, h_z, h_n = np.split(gh, 3, axis=1)
        r, z = sigmoid(i_r + h_r), sigmoid(i_z + h_z)
        n = np.tanh(i_n + r * h_n)
        h = (1 - z) * n + z * h
        hs.append(h), steps.append((r, z, n, h_n))
    return np.stack(hs), (xs, h0, np.stack(hs), steps, (weight_ih, weight_hh, bias_ih, bias_hh))


def gru_backward(d_hs, cache):
    """Gradients of all parameters, of xs and of h0, from d_hs (T, B, H)."""
    xs, h0, hs, steps, params = cache
    weight_ih, weight_hh, _, _ = params
    grads, d_xs = _zero_grads(*params), np.zeros_like(xs)
    d_h = np.zeros_like(h0)
    for t in reversed(range(len(xs))):
        r, z, n, h_n = steps[t]
        h_prev = hs[t - 1] if t > 0 else h0
        d_h = d_h + d_hs[t]
        d_n = d_h * (1 - z) * (1 - n**2)  # at n's pre-activation
        d_z = d_h * (h_prev - n) * z * (1 - z)
        d_r = d_n * h_n * r * (1 - r)
        d_gi = np.concatenate([d_r, d_z, d_n], axis=1)
        d_gh = np.concatenate([d_r, d_z, d_n * r], axis=1)  # r scales the hidden side of n
        _accumulate(grads, d_gi, d_gh, xs[t], h_prev)
        d_xs[t] = d_gi @ weight_ih
        d_h = d_h * z + d_gh @ weight_hh
    return grads, d_xs, d_h
