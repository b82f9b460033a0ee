"""seqlib.nn.RNNCell / LSTMCell / GRUCell against torch: outputs and gradients."""

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from torch_reference import assert_close

import seqlib

KINDS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]


def make_pair(kind, input_size, hidden_size, bias):
    torch_class = {"rnn": torch.nn.RNNCell, "lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell}[kind[:4].rstrip("_")]
    options = {"nonlinearity": kind.split("_")[1]} if kind.startswith("rnn") else {}
    theirs = torch_class(input_size, hidden_size, bias=bias, **options)
    return seqlib.from_torch(theirs), theirs


@st.composite
def cell_cases(draw):
    return {
        "kind": draw(st.sampled_from(KINDS)),
        "input_size": draw(st.integers(1, 6)),
        "hidden_size": draw(st.integers(1, 6)),
        "batch": draw(st.none() | st.integers(1, 4)),  # None: unbatched (D,) input
        "bias": draw(st.booleans()),
        "with_state": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@given(cell_cases())
def test_cells_match_torch_outputs_and_all_gradients(case):
    torch.manual_seed(case["seed"])
    ours, theirs = make_pair(case["kind"], case["input_size"], case["hidden_size"], case["bias"])
    rng = np.random.default_rng(case["seed"])
    lead = () if case["batch"] is None else (case["batch"],)
    x = rng.standard_normal((*lead, case["input_size"])).astype(np.float32)
    h = rng.standard_normal((*lead, case["hidden_size"])).astype(np.float32)
    c = rng.standard_normal((*lead, case["hidden_size"])).astype(np.float32)
    is_lstm = case["kind"] == "lstm"
    x_t, h_t, c_t = (torch.from_numpy(a).requires_grad_() for a in (x, h, c))
    state_t = ((h_t, c_t) if is_lstm else h_t) if case["with_state"] else None
    out_t = theirs(x_t, state_t)
    outs_t = out_t if is_lstm else (out_t,)
    weights = [rng.standard_normal(tuple(o.shape)).astype(np.float32) for o in outs_t]
    sum(((o * torch.from_numpy(w)).sum() for o, w in zip(outs_t, weights, strict=True))).backward()

    def loss(model, x, h, c):
        state = ((h, c) if is_lstm else h) if case["with_state"] else None
        outs = model(x, state)
        outs = outs if is_lstm else (outs,)
        return sum((o * mx.array(w)).sum() for o, w in zip(outs, weights, strict=True))

    outs = ours(mx.array(x), ((mx.array(h), mx.array(c)) if is_lstm else mx.array(h)) if case["with_state"] else None)
    for got, expected in zip(outs if is_lstm else (outs,), outs_t, strict=True):
        assert_close(got, expected, rtol=1e-5, atol=1e-6)
    _, param_grads = mlx.nn.value_and_grad(ours, loss)(ours, mx.array(x), mx.array(h), mx.array(c))
    for name, grad in tree_flatten(param_grads):
        assert_close(grad, getattr(theirs, name).grad, rtol=1e-5, atol=1e-6, what=name)
    input_grads = mx.grad(lambda x, h, c: loss(ours, x, h, c), argnums=(0, 1, 2))(mx.array(x), mx.array(h), mx.array(c))
    assert_close(input_grads[0], x_t.grad, rtol=1e-5, atol=1e-6, what="input")
    if case["with_state"]:
        assert_close(input_grads[1], h_t.grad, rtol=1e-5, atol=1e-6, what="h")
        if is_lstm:
            assert_close(input_grads[2], c_t.grad, rtol=1e-5, atol=1e-6, what="c")


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names_are_torchs_and_init_is_uniform_in_one_over_sqrt_h(kind):
    ours, theirs = make_pair(kind, 5, 16, True)
    assert [name for name, _ in tree_flatten(ours.parameters())] == list(theirs.state_dict())
    mx.random.seed(0)
    fresh = type(ours)(5, 400)
    weight = np.array(fresh.weight_hh)
    assert np.abs(weight).max() <= 1 / 20 and np.abs(weight).max() > 0.049
    assert abs(weight.mean()) < 0.001


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: seqlib.nn.LSTMCell(3, 4)(mx.zeros((2, 5))), ValueError, ["input", "(batch, 3)", "(2, 5)"]),
        (lambda: seqlib.nn.GRUCell(3, 4)(mx.zeros((1, 2, 3))), ValueError, ["input", "(1, 2, 3)"]),
        (lambda: seqlib.nn.GRUCell(3, 4)(mx.zeros((2, 3)), mx.zeros((3, 4))), ValueError, ["hx", "(2, 4)", "(3, 4)"]),
        (lambda: seqlib.nn.LSTMCell(3, 4)(mx.zeros((2, 3)), mx.zeros((2, 4))), TypeError, ["hx", "tuple"]),
        (lambda: seqlib.nn.LSTMCell(3, 4)(mx.zeros((2, 3)), (mx.zeros((2, 4)), mx.zeros((2, 3)))), ValueError,
         ["hx[1]", "(2, 4)", "(2, 3)"]),
        (lambda: seqlib.nn.RNNCell(3, 4, nonlinearity="sigmoid"), ValueError, ["nonlinearity", "sigmoid"]),
        (lambda: seqlib.nn.RNNCell(-1, 4), ValueError, ["input_size", "-1"]),  # torch's cells allow 0
        (lambda: seqlib.nn.RNNCell(3, 4)(np.zeros((2, 3))), TypeError, ["input", "ndarray"]),
    ],
)
def test_bad_input_raises_a_clear_error(call, error, words):
    with pytest.raises(error) as raised:
        call()
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))
