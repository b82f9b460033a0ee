"""seqlib.reference: scalar cells, NumPy cells and hand-written BPTT against torch."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from seqlib import reference as ref

TORCH_CELLS = {"rnn": torch.nn.RNNCell, "lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell}
TORCH_LAYERS = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}


def params_of(module, suffix=""):
    return [getattr(module, name + suffix).detach().double().numpy()
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]  # fmt: skip


@pytest.mark.parametrize("kind", ["rnn", "rnn_relu", "lstm", "gru"])
def test_scalar_cells_match_torch_one_unit_cells(kind):
    torch.manual_seed(0)
    nonlinearity = "relu" if kind == "rnn_relu" else "tanh"
    cell = TORCH_CELLS[kind.split("_")[0]](1, 1, **({"nonlinearity": nonlinearity} if "rnn" in kind else {}))
    w_ih, w_hh, b_ih, b_hh = (p.reshape(-1).tolist() for p in params_of(cell))
    for x, h, c in [(0.5, -0.3, 0.8), (-1.2, 0.9, -0.1), (2.0, 0.0, 0.0)]:
        x_t, h_t, c_t = (torch.tensor([[v]], dtype=torch.float64) for v in (x, h, c))
        cell = cell.double()
        if kind.startswith("rnn"):
            expected = cell(x_t, h_t).item()
            got = ref.rnn_cell_scalar(x, h, w_ih[0], w_hh[0], b_ih[0], b_hh[0], nonlinearity)
            assert got == pytest.approx(expected, abs=1e-12)
        elif kind == "lstm":
            h_new, c_new = cell(x_t, (h_t, c_t))
            got = ref.lstm_cell_scalar(x, h, c, w_ih, w_hh, b_ih, b_hh)
            assert got == pytest.approx((h_new.item(), c_new.item()), abs=1e-12)
        else:
            assert ref.gru_cell_scalar(x, h, w_ih, w_hh, b_ih, b_hh) == pytest.approx(cell(x_t, h_t).item(), abs=1e-12)


@st.composite
def sizes(draw):
    return (draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 5)),
            draw(st.integers(0, 2**31 - 1)))  # fmt: skip


@pytest.mark.parametrize("kind", ["rnn", "rnn_relu", "lstm", "gru"])
@given(sizes())
def test_bptt_by_hand_matches_torch_autograd(kind, size):
    steps, batch, input_size, hidden_size, seed = size
    torch.manual_seed(seed)
    nonlinearity = "relu" if kind == "rnn_relu" else "tanh"
    base = kind.split("_")[0]
    layer = TORCH_LAYERS[base](input_size, hidden_size, **({"nonlinearity": nonlinearity} if base == "rnn" else {}))
    layer = layer.double()
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((steps, batch, input_size))
    h0 = rng.standard_normal((batch, hidden_size))
    c0 = rng.standard_normal((batch, hidden_size))
    d_hs = rng.standard_normal((steps, batch, hidden_size))
    params = params_of(layer, "_l0")

    xs_t, h0_t, c0_t = (torch.tensor(a, requires_grad=True) for a in (xs, h0, c0))
    if base == "lstm":
        out_t, _ = layer(xs_t, (h0_t[None], c0_t[None]))
        hs, _, cache = ref.lstm_forward(xs, h0, c0, *params)
        grads, d_xs, d_h0, d_c0 = ref.lstm_backward(d_hs, cache)
    elif base == "gru":
        out_t, _ = layer(xs_t, h0_t[None])
        hs, cache = ref.gru_forward(xs, h0, *params)
        grads, d_xs, d_h0 = ref.gru_backward(d_hs, cache)
    else:
        out_t, _ = layer(xs_t, h0_t[None])
        hs, cache = ref.rnn_forward(xs, h0, *params, nonlinearity=nonlinearity)
        grads, d_xs, d_h0 = ref.rnn_backward(d_hs, cache)
    (out_t * torch.from_numpy(d_hs)).sum().backward()

    np.testing.assert_allclose(hs, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        np.testing.assert_allclose(grads[name], getattr(layer, name + "_l0").grad.numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(d_xs, xs_t.grad.numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(d_h0, h0_t.grad.numpy(), rtol=1e-9, atol=1e-10)
    if base == "lstm":
        np.testing.assert_allclose(d_c0, c0_t.grad.numpy(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_vector_cells_match_torch_cells(kind):
    torch.manual_seed(1)
    cell = TORCH_CELLS[kind](3, 4).double()
    rng = np.random.default_rng(1)
    x, h, c = rng.standard_normal((2, 3)), rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    params = params_of(cell)
    x_t, h_t, c_t = (torch.from_numpy(a) for a in (x, h, c))
    if kind == "lstm":
        expected = [t.detach().numpy() for t in cell(x_t, (h_t, c_t))]
        got = ref.lstm_cell(x, h, c, *params)
    else:
        expected = cell(x_t, h_t).detach().numpy()
        got = getattr(ref, f"{kind}_cell")(x, h, *params)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_scalar_lstm_gates_are_the_gates_the_vector_forward_caches():
    rng = np.random.default_rng(3)
    w_ih, w_hh, b_ih, b_hh = (rng.standard_normal(4) for _ in range(4))
    xs = rng.standard_normal((6, 1, 1))
    _, _, cache = ref.lstm_forward(xs, np.zeros((1, 1)), np.zeros((1, 1)), w_ih[:, None], w_hh[:, None], b_ih, b_hh)
    hs, cached_gates = cache[3], cache[5]
    h = 0.0
    for t in range(len(xs)):
        gates = ref.lstm_gates_scalar(xs[t, 0, 0], h, w_ih, w_hh, b_ih, b_hh)
        assert gates == pytest.approx([gate.item() for gate in cached_gates[t]], abs=1e-12)
        h = hs[t].item()
