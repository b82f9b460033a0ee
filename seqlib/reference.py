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

PyTorch's equations (``*`` is elementwise, ``σ`` the logistic sigmoid)::

    RNN   h' = tanh(W_ih x + b_ih + W_hh h + b_hh)          (or relu)
    LSTM  i, f, g, o = σ(.), σ(.), tanh(.), σ(.) of  W_ih x + b_ih + W_hh h + b_hh
          c' = f * c + i * g          h' = o * tanh(c')
    GRU   r, z = σ(.) of the first two blocks of  W_ih x + b_ih + W_hh h + b_hh
          n = tanh(W_in x + b_in + r * (W_hn h + b_hn))      h' = (1 - z) * n + z * h

4. *Embeddings*: what the embedding kernels compute, in plain NumPy, with
   torch.nn.functional's argument names and order.  A table ``weight`` (V, D)
   holds one row per index; a lookup copies rows, a bag pools them (sum, mean
   or max), and each backward sends the output's gradient back to the rows it
   came from.  ``embedding_renorm`` is torch's ``max_norm`` rescaling.
"""

from __future__ import annotations

import math

import numpy as np

from seqlib._bags import BAG_MODES, bag_bounds
from seqlib._checks import (
    check_choice,
    check_index_range,
    check_max_norm,
    check_nonnegative_ints,
    normalize_padding_idx,
)

__all__ = [
    "embedding", "embedding_backward", "embedding_bag", "embedding_bag_backward", "embedding_renorm",
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


# ---------------------------------------------------------------- 4. embeddings


def _check_indices(value, name: str) -> np.ndarray:
    """Raise a TypeError unless ``value`` is a NumPy integer array (floats and bools refused, as in torch)."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array of integers, got {type(value).__name__}")
    if not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer dtype (int32, int64, ...), got {value.dtype}")
    return value


def _check_floats(value, name: str, ndim: int | None = None, what: str = "") -> np.ndarray:
    """Raise unless ``value`` is a floating NumPy array, with ``ndim`` dimensions where given."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a NumPy array, got {type(value).__name__}")
    if not np.issubdtype(value.dtype, np.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D {what}array, got shape {value.shape}")
    return value


def _check_table(weight, name: str = "weight") -> np.ndarray:
    return _check_floats(weight, name, ndim=2, what="(num_embeddings, embedding_dim) ")


def _row_norm(row: np.ndarray, norm_type: float) -> float:
    """||row||_p = (sum_d |row_d|^p)^(1/p), or max_d |row_d| for p = inf."""
    if math.isinf(norm_type):
        return float(np.max(np.abs(row), initial=0.0))
    return float(np.sum(np.abs(row) ** norm_type) ** (1.0 / norm_type))


def embedding(input, weight, padding_idx=None):
    """Look up one row of ``weight`` per index:  ``out[..., :] = weight[input[...], :]``.

    input ``(*)`` integers in [0, V), weight (V, D) -> ``(*input.shape, D)``, a copy in the
    dtype of ``weight``.  ``padding_idx`` (negative counts from the end, as in torch)
    changes nothing here, the padding row is read like any other: it only keeps
    that row's gradient at zero (see :func:`embedding_backward`).
    """
    indices = _check_indices(input, "input")
    num_embeddings = _check_table(weight).shape[0]
    check_index_range(indices, num_embeddings, "input")
    normalize_padding_idx(padding_idx, num_embeddings)  # checked, though the lookup does not use it
    return weight[indices]  # NumPy's fancy indexing is the lookup: one row per index


def embedding_backward(d_out, input, num_embeddings, padding_idx=None, scale_grad_by_freq=False):
    """The gradient of :func:`embedding` with respect to ``weight``: a scatter-add.

    Output row n is a copy of table row input[n], so its gradient goes back there;
    a row looked up several times collects the sum::

        d_weight[v] = sum over {n : input[n] = v} of d_out[n]

    - ``padding_idx``: that row gets no gradient (it stays zero).
    - ``scale_grad_by_freq``: each term is divided by count(v), how often v occurs
      in ``input``, so a row's gradient is the mean of its lookups' gradients.

    d_out ``(*input.shape, D)``, input ``(*)`` -> d_weight (num_embeddings, D), dtype of d_out.
    """
    indices = _check_indices(input, "input")
    check_nonnegative_ints(num_embeddings=num_embeddings)
    check_index_range(indices, num_embeddings, "input")
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    _check_floats(d_out, "d_out")
    if d_out.shape[:-1] != indices.shape or d_out.ndim != indices.ndim + 1:
        raise ValueError(f"d_out: expected shape (*input.shape, D) with input.shape {indices.shape}, got {d_out.shape}")

    flat_indices = indices.reshape(-1)  # (N,)
    d_rows = d_out.reshape(flat_indices.size, d_out.shape[-1])  # (N, D)
    counts = np.bincount(flat_indices, minlength=num_embeddings)  # count(v) for every row v
    d_weight = np.zeros((num_embeddings, d_out.shape[-1]), dtype=d_out.dtype)
    for row, d_row in zip(flat_indices, d_rows, strict=True):
        if row == padding_idx:
            continue
        d_weight[row] += d_row / counts[row] if scale_grad_by_freq else d_row
    return d_weight


def embedding_renorm(weight, input, max_norm, norm_type=2.0):
    """Return a copy of ``weight`` whose rows referenced by ``input`` have norm at most about ``max_norm``.

    torch's ``embedding_renorm_`` (what ``max_norm`` does to a lookup), without the in-place
    update.  Each distinct row v in ``input`` is rescaled once, however often it occurs::

        ||w||_p = (sum_d |w_d|^p)^(1/p)        (p = norm_type; p = inf: max_d |w_d|)
        w_v <- w_v * max_norm / (||w_v||_p + 1e-7)     if ||w_v||_p > max_norm

    Rows not in ``input``, and rows within the limit, are returned unchanged.
    weight (V, D), input ``(*)`` integers in [0, V) -> (V, D), dtype of weight.
    ``max_norm`` >= 0 and ``norm_type`` > 0 (torch also takes negative values; refused here).
    """
    num_embeddings = _check_table(weight).shape[0]
    indices = _check_indices(input, "input")
    check_index_range(indices, num_embeddings, "input")
    check_max_norm(max_norm, norm_type, required=True)
    renormed = weight.copy()
    for row in np.unique(indices):
        norm = _row_norm(weight[row], norm_type)
        if norm > max_norm:
            renormed[row] = weight[row] * (max_norm / (norm + 1e-7))
    return renormed


def _bags(input, offsets, include_last_offset) -> tuple[np.ndarray, np.ndarray]:
    """torch's two ways of giving bags, as one: the flat indices (N,) and the bounds (B + 1,).

    Bag b holds the entries ``indices[bounds[b]:bounds[b + 1]]``.

    - 2-D input (B, L), offsets None: each row is a bag, bounds = 0, L, 2L, ..., BL.
    - 1-D input (N,) with offsets (B,): bag b starts at offsets[b] and runs to the next
      offset, the last one to the end of input.  With ``include_last_offset``, offsets
      has B + 1 entries and the last one closes the last bag; it must then be N
      (torch's kernels disagree about entries after it, pytorch#52851: refused).
    """
    indices = _check_indices(input, "input")
    if indices.ndim == 2:
        if offsets is not None:
            raise ValueError(
                f"offsets: must be None when input is 2-D (each row is a bag), got {type(offsets).__name__}"
            )
        num_bags, bag_size = indices.shape
        return indices.reshape(-1), np.arange(num_bags + 1) * bag_size
    if indices.ndim != 1:
        raise ValueError(f"input: expected a 1-D (with offsets) or 2-D array, got shape {indices.shape}")
    if offsets is None:
        raise ValueError("offsets: required when input is 1-D (it says where each bag starts), got None")
    _check_indices(offsets, "offsets")
    return indices, bag_bounds(offsets, indices.size, include_last_offset)  # checks offsets too


def _counted_entries(indices: np.ndarray, start: int, end: int, padding_idx: int | None) -> list[int]:
    """The positions n in [start, end) whose index is not ``padding_idx``: the entries a bag pools."""
    return [n for n in range(start, end) if indices[n] != padding_idx]


def _check_bag_arguments(input, offsets, num_embeddings, mode, per_sample_weights, include_last_offset, padding_idx):
    """What both bag functions check: the flat indices, bounds, padding row and flat sample weights (or None)."""
    check_choice("mode", mode, BAG_MODES)
    indices, bounds = _bags(input, offsets, include_last_offset)
    check_index_range(indices, num_embeddings, "input")
    padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
    if per_sample_weights is None:
        return indices, bounds, padding_idx, None
    if mode != "sum":
        raise ValueError(f"per_sample_weights: only supported with mode='sum', got mode={mode!r}")
    _check_floats(per_sample_weights, "per_sample_weights")
    if per_sample_weights.shape != input.shape:
        raise ValueError(
            f"per_sample_weights: expected the shape of input {input.shape}, got {per_sample_weights.shape}"
        )
    return indices, bounds, padding_idx, per_sample_weights.reshape(-1)


def embedding_bag(input, weight, offsets=None, mode="mean", per_sample_weights=None, include_last_offset=False,
                  padding_idx=None):  # fmt: skip
    """Pool each bag of looked-up rows into one row: torch's CPU ``embedding_bag``.

    For bag b with counted entries E_b (its entries whose index is not ``padding_idx``)::

        sum   out[b] = sum over n in E_b of  s[n] * weight[input[n]]     (s: per_sample_weights, else 1)
        mean  out[b] = (sum over n in E_b of weight[input[n]]) / |E_b|
        max   out[b, d] = max over n in E_b of weight[input[n], d]

    An empty bag (E_b empty) gives zeros.  ``max`` works column by column as torch's
    kernel does: it starts from the first counted entry and moves only to a strictly
    greater value, so the first of equal values wins and a NaN wins only as the first
    entry (nothing is greater than a NaN, and a NaN is greater than nothing).

    Bags come as in torch (see :func:`_bags`): input (N,) with offsets (B,), or (B + 1,)
    with ``include_last_offset``; or input (B, L) with offsets None.  weight (V, D);
    ``per_sample_weights`` has input's shape, for mode "sum" only.

    Returns out (B, D) in weight's dtype, and max_entry (B, D) int64: for mode "max"
    the position in (flattened) input of the entry each output element came from,
    -1 for empty bags; for the other modes -1 everywhere.
    """
    num_embeddings, embedding_dim = _check_table(weight).shape
    indices, bounds, padding_idx, sample_weights = _check_bag_arguments(
        input, offsets, num_embeddings, mode, per_sample_weights, include_last_offset, padding_idx
    )
    num_bags = bounds.size - 1
    out = np.zeros((num_bags, embedding_dim), dtype=weight.dtype)
    max_entry = np.full((num_bags, embedding_dim), -1, dtype=np.int64)
    for bag in range(num_bags):
        entries = _counted_entries(indices, bounds[bag], bounds[bag + 1], padding_idx)
        for n in entries:
            row = weight[indices[n]]
            if mode == "max":
                wins = np.ones(embedding_dim, dtype=bool) if n == entries[0] else row > out[bag]
                out[bag, wins] = row[wins]
                max_entry[bag, wins] = n
            elif sample_weights is not None:
                out[bag] += sample_weights[n] * row
            else:
                out[bag] += row
        if mode == "mean" and entries:
            out[bag] /= len(entries)
    return out, max_entry


def embedding_bag_backward(d_out, input, offsets, num_embeddings, mode="mean", per_sample_weights=None,
                           include_last_offset=False, padding_idx=None, weight=None):  # fmt: skip
    """The gradients of :func:`embedding_bag`: with respect to the table, and to ``per_sample_weights``.

    Every counted entry n of bag b sends its bag's output gradient back to its row
    (padding entries send nothing)::

        sum   d_weight[input[n]] += s[n] * d_out[b]     and   d_s[n] = d_out[b] · weight[input[n]]
        mean  d_weight[input[n]] += d_out[b] / |E_b|
        max   d_weight[input[m], d] += d_out[b, d]     where m = max_entry[b, d], the entry that won

    So max mode needs ``weight`` (to find the winners, by running the forward), and so
    do per_sample_weights' gradients (the dot products); both raise a ValueError without it.

    d_out (B, D), input and offsets as for :func:`embedding_bag` -> d_weight
    (num_embeddings, D) in d_out's dtype, and d_per_sample_weights (input's shape,
    zero for padding entries and entries in no bag) or None without per_sample_weights.
    """
    check_nonnegative_ints(num_embeddings=num_embeddings)
    indices, bounds, padding_idx, sample_weights = _check_bag_arguments(
        input, offsets, num_embeddings, mode, per_sample_weights, include_last_offset, padding_idx
    )
    num_bags = bounds.size - 1
    _check_floats(d_out, "d_out", ndim=2, what="(num_bags, embedding_dim) ")
    if d_out.shape[0] != num_bags:
        raise ValueError(f"d_out: expected one row per bag ({num_bags} bags), got shape {d_out.shape}")
    embedding_dim = d_out.shape[1]
    if weight is None and (mode == "max" or sample_weights is not None):
        needs = "mode='max' (to find each bag's winners)" if mode == "max" else "per_sample_weights' gradient"
        raise ValueError(f"weight: required for {needs}, got None")
    if weight is not None and _check_table(weight).shape != (num_embeddings, embedding_dim):
        raise ValueError(
            f"weight: expected shape (num_embeddings, D) = {(num_embeddings, embedding_dim)}, got {weight.shape}"
        )

    d_weight = np.zeros((num_embeddings, embedding_dim), dtype=d_out.dtype)
    if mode == "max":
        _, max_entry = embedding_bag(input, weight, offsets, "max", None, include_last_offset, padding_idx)
        for bag in range(num_bags):
            for column in range(embedding_dim):
                winner = max_entry[bag, column]
                if winner >= 0:  # -1: an empty bag, whose zeros came from no row
                    d_weight[indices[winner], column] += d_out[bag, column]
        return d_weight, None

    d_sample_weights = None if sample_weights is None else np.zeros_like(sample_weights)
    for bag in range(num_bags):
        entries = _counted_entries(indices, bounds[bag], bounds[bag + 1], padding_idx)
        for n in entries:
            if mode == "mean":
                d_weight[indices[n]] += d_out[bag] / len(entries)
            elif sample_weights is not None:
                d_weight[indices[n]] += sample_weights[n] * d_out[bag]
                d_sample_weights[n] = np.dot(d_out[bag], weight[indices[n]])
            else:
                d_weight[indices[n]] += d_out[bag]
    if d_sample_weights is not None:
        d_sample_weights = d_sample_weights.reshape(input.shape)
    return d_weight, d_sample_weights
