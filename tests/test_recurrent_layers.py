"""seqlib.nn.RNN / LSTM / GRU against torch: outputs, final states and every gradient, over drawn configurations."""

import warnings

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from torch_reference import assert_close, loss_weights

import seqlib
from seqlib.nn.utils import rnn as packing

KINDS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]
TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}


def make_torch_layer(kind, input_size, hidden_size, **options):
    if kind.startswith("rnn"):
        return torch.nn.RNN(input_size, hidden_size, nonlinearity=kind[4:], **options)
    return {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](input_size, hidden_size, **options)


@st.composite
def layer_cases(draw):
    kind = draw(st.sampled_from(KINDS))
    hidden_size = draw(st.integers(1, 6))
    case = {
        "kind": kind,
        "input_size": draw(st.integers(1, 5)),
        "hidden_size": hidden_size,
        "num_layers": draw(st.integers(1, 3)),
        "bias": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bidirectional": draw(st.booleans()),
        "proj_size": draw(st.integers(0, hidden_size - 1)) if kind == "lstm" and draw(st.booleans()) else 0,
        "steps": draw(st.integers(1, 5)),
        "batch": draw(st.none() | st.integers(1, 4)),  # None: unbatched (T, D) input
        "with_state": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    packed = case["batch"] is not None and draw(st.booleans())
    lengths = st.lists(st.integers(1, case["steps"]), min_size=case["batch"], max_size=case["batch"])
    case["lengths"] = draw(lengths) if packed else None
    case["enforce_sorted"] = packed and draw(st.booleans())
    if case["enforce_sorted"]:
        case["lengths"] = sorted(case["lengths"], reverse=True)
    return case


def torch_options(case):
    options = {key: case[key] for key in ("num_layers", "bias", "batch_first", "bidirectional")}
    if case["proj_size"]:
        options["proj_size"] = case["proj_size"]
    return options


def draw_inputs(case, layer):
    rng = np.random.default_rng(case["seed"])
    steps, batch = case["steps"], case["batch"]
    lead = (steps,) if batch is None else ((batch, steps) if case["batch_first"] else (steps, batch))
    x = rng.standard_normal((*lead, case["input_size"])).astype(np.float32)
    layers = case["num_layers"] * (2 if case["bidirectional"] else 1)
    state_lead = (layers,) if batch is None else (layers, batch)
    h0 = rng.standard_normal((*state_lead, case["proj_size"] or case["hidden_size"])).astype(np.float32)
    c0 = rng.standard_normal((*state_lead, case["hidden_size"])).astype(np.float32)
    return x, h0, c0


def run_torch(case, layer, x, h0, c0):
    is_lstm = case["kind"] == "lstm"
    x_t, h_t, c_t = (torch.from_numpy(a).requires_grad_() for a in (x, h0, c0))
    state = ((h_t, c_t) if is_lstm else h_t) if case["with_state"] else None
    sequence = x_t
    if case["lengths"] is not None:
        sequence = torch.nn.utils.rnn.pack_padded_sequence(
            x_t, case["lengths"], batch_first=case["batch_first"], enforce_sorted=case["enforce_sorted"]
        )
    output, final = layer(sequence, state)
    if case["lengths"] is not None:
        output, _ = torch.nn.utils.rnn.pad_packed_sequence(output, batch_first=case["batch_first"])
    finals = final if is_lstm else (final,)
    outputs = (output, *finals)
    weights = [loss_weights(tuple(o.shape), seed=k) for k, o in enumerate(outputs)]
    sum((o * torch.from_numpy(w)).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    return outputs, weights, (x_t.grad, h_t.grad, c_t.grad)


def seqlib_loss(case, weights):
    is_lstm = case["kind"] == "lstm"

    def loss(model, x, h0, c0):
        state = ((h0, c0) if is_lstm else h0) if case["with_state"] else None
        sequence = x
        if case["lengths"] is not None:
            sequence = packing.pack_padded_sequence(
                x, case["lengths"], batch_first=case["batch_first"], enforce_sorted=case["enforce_sorted"]
            )
        output, final = model(sequence, state)
        if case["lengths"] is not None:
            output, _ = packing.pad_packed_sequence(output, batch_first=case["batch_first"])
        outputs = (output, *(final if is_lstm else (final,)))
        return sum((o * mx.array(w)).sum() for o, w in zip(outputs, weights, strict=True)), outputs

    return loss


@settings(max_examples=150)  # the configuration space is large and each example takes milliseconds
@given(layer_cases())
def test_layers_match_torch_outputs_states_and_all_gradients(case):
    torch.manual_seed(case["seed"])
    theirs = make_torch_layer(case["kind"], case["input_size"], case["hidden_size"], **torch_options(case))
    ours = seqlib.from_torch(theirs)
    x, h0, c0 = draw_inputs(case, theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "LSTM with projections is not supported with oneDNN"
        expected, weights, expected_input_grads = run_torch(case, theirs, x, h0, c0)
    loss = seqlib_loss(case, weights)
    (_, outputs), param_grads = mlx.nn.value_and_grad(ours, loss)(ours, mx.array(x), mx.array(h0), mx.array(c0))
    for got, want, what in zip(outputs, expected, ["output", "h_n", "c_n"], strict=False):
        assert_close(got, want, **TOLERANCE, what=what)
    grads = dict(tree_flatten(param_grads))
    assert list(grads) == list(theirs.state_dict())
    for name, grad in grads.items():
        assert_close(grad, getattr(theirs, name).grad, **TOLERANCE, what=name)
    input_grads = mx.grad(lambda *a: loss(ours, *a)[0], argnums=(0, 1, 2))(mx.array(x), mx.array(h0), mx.array(c0))
    assert_close(input_grads[0], expected_input_grads[0], **TOLERANCE, what="d input")
    if case["with_state"]:
        assert_close(input_grads[1], expected_input_grads[1], **TOLERANCE, what="d h_0")
        if case["kind"] == "lstm":
            assert_close(input_grads[2], expected_input_grads[2], **TOLERANCE, what="d c_0")


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names_order_and_init_follow_torch(kind):
    options = {"num_layers": 2, "bidirectional": True} | ({"proj_size": 3} if kind == "lstm" else {})
    theirs = make_torch_layer(kind, 5, 7, **options)
    ours = seqlib.from_torch(theirs)
    assert list(dict(tree_flatten(ours.parameters()))) == list(theirs.state_dict())
    for name, value in theirs.state_dict().items():
        assert tuple(getattr(ours, name).shape) == tuple(value.shape), name
    mx.random.seed(0)
    fresh = type(ours)(5, 400, num_layers=2)
    values = np.concatenate([np.array(v).ravel() for _, v in tree_flatten(fresh.parameters())])
    bound = 1 / np.sqrt(400)
    assert values.min() >= -bound and values.max() <= bound
    assert values.min() < -0.95 * bound and values.max() > 0.95 * bound  # spread over the whole range


@pytest.mark.parametrize("kind", KINDS)
def test_layer_equals_its_cells_stepped_by_hand(kind):
    """One layer, one direction, is the cell applied step by step, with the same weights."""
    layer = seqlib.nn.LSTM(3, 4) if kind == "lstm" else (
        seqlib.nn.GRU(3, 4) if kind == "gru" else seqlib.nn.RNN(3, 4, nonlinearity=kind[4:]))  # fmt: skip
    cell_class = {"lstm": seqlib.nn.LSTMCell, "gru": seqlib.nn.GRUCell}.get(kind)
    cell = cell_class(3, 4) if cell_class else seqlib.nn.RNNCell(3, 4, nonlinearity=kind[4:])
    cell.update({name.replace("_l0", ""): value for name, value in layer.parameters().items()})
    x = mx.random.normal((6, 2, 3))
    output, _ = layer(x)
    state = None
    for t in range(6):
        state = cell(x[t], state)
        h = state[0] if kind == "lstm" else state
        np.testing.assert_array_equal(np.array(output[t]), np.array(h))


def test_dropout_only_between_layers_and_only_in_training():
    mx.random.seed(3)
    layer = seqlib.nn.LSTM(4, 8, num_layers=3, dropout=0.5)
    x = mx.random.normal((5, 2, 4))
    layer.eval()
    first, second = layer(x)[0], layer(x)[0]
    np.testing.assert_array_equal(np.array(first), np.array(second))
    no_dropout = seqlib.nn.LSTM(4, 8, num_layers=3)
    no_dropout.update(layer.parameters())
    np.testing.assert_array_equal(np.array(no_dropout(x)[0]), np.array(first))
    layer.train()
    assert not np.allclose(np.array(layer(x)[0]), np.array(first))
    assert not np.allclose(np.array(layer(x)[0]), np.array(layer(x)[0]))  # a fresh mask each call


def test_dropout_is_inverted_dropout_with_the_given_rate():
    from seqlib.nn.recurrent import _dropout

    mx.random.seed(0)
    rows = mx.ones((400, 500))
    dropped = np.array(_dropout(rows, 0.3))
    np.testing.assert_allclose(np.unique(dropped), [0.0, 1 / 0.7], rtol=1e-6)
    assert abs((dropped == 0).mean() - 0.3) < 0.005
    assert abs(dropped.mean() - 1.0) < 0.01  # expectation unchanged
    assert np.array(_dropout(rows, 1.0)).max() == 0.0


def test_dropout_with_one_layer_warns_as_torch_does():
    with pytest.warns(UserWarning, match="dropout"):
        seqlib.nn.GRU(2, 3, dropout=0.2)


def test_from_torch_keeps_training_mode_and_round_trips_through_a_state_dict(tmp_path):
    theirs = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, dropout=0.1).eval()
    ours = seqlib.from_torch(theirs)
    assert not ours.training
    torch.save({k: torch.from_numpy(v) for k, v in ours.torch_state_dict().items()}, tmp_path / "lstm.pt")
    loaded = torch.load(tmp_path / "lstm.pt")
    for key, value in theirs.state_dict().items():
        assert torch.equal(loaded[key], value), key
    again = seqlib.nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2)
    again.load_torch_state_dict(loaded)
    for key, value in ours.torch_state_dict().items():
        np.testing.assert_array_equal(again.torch_state_dict()[key], value)


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_batch_first_and_default_state_agree_with_the_batched_call(kind):
    torch.manual_seed(0)
    ours = seqlib.from_torch(make_torch_layer(kind, 3, 4, num_layers=2, bidirectional=True))
    x = mx.random.normal((5, 3))
    single, single_final = ours(x)
    batched, batched_final = ours(x[:, None])
    np.testing.assert_allclose(np.array(single), np.array(batched[:, 0]), rtol=1e-6, atol=1e-7)
    single_final = single_final if kind == "lstm" else (single_final,)
    batched_final = batched_final if kind == "lstm" else (batched_final,)
    for a, b in zip(single_final, batched_final, strict=True):
        assert a.shape == (4, 4)
        np.testing.assert_allclose(np.array(a), np.array(b[:, 0]), rtol=1e-6, atol=1e-7)
    ours.batch_first = True
    first, _ = ours(x[None])
    np.testing.assert_allclose(np.array(first[0]), np.array(batched[:, 0]), rtol=1e-6, atol=1e-7)


def test_packed_sequences_do_no_work_on_padding_and_final_states_are_true_last_steps():
    """Each packed sequence gives the same result as running it alone, unpadded."""
    torch.manual_seed(1)
    ours = seqlib.from_torch(torch.nn.LSTM(2, 3, bidirectional=True))
    sequences = [mx.random.normal((length, 2)) for length in (2, 5, 1, 4)]
    output, (h_n, c_n) = ours(packing.pack_sequence(sequences, enforce_sorted=False))
    for b, (sequence, unpacked) in enumerate(zip(sequences, packing.unpack_sequence(output), strict=True)):
        alone, (h_alone, c_alone) = ours(sequence)
        np.testing.assert_allclose(np.array(unpacked), np.array(alone), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.array(h_n[:, b]), np.array(h_alone), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.array(c_n[:, b]), np.array(c_alone), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_gate_math_is_within_1e6_of_torch_on_a_long_sequence(kind):
    """The rational tanh/sigmoid (seqlib.activations) keep a 100-step, 64-unit layer within 1e-6 of torch."""
    torch.manual_seed(0)
    theirs = make_torch_layer(kind, 16, 64, num_layers=2)
    ours = seqlib.from_torch(theirs)
    x = torch.randn(100, 8, 16) * 3
    expected = theirs(x)[0].detach().numpy()
    got = np.array(ours(mx.array(x.numpy()))[0])
    assert np.abs(got - expected).max() <= 1e-6 * max(1.0, np.abs(expected).max())


BAD_CALLS = [
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((2, 5, 2))), ValueError, "input_size=3"),
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5,))), ValueError, "input"),
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((2, 5, 4, 3))), ValueError, "3-D"),
    (lambda: seqlib.nn.LSTM(3, 4)(np.zeros((2, 5, 3))), TypeError, "PackedSequence"),
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((0, 2, 3))), ValueError, "at least one time step"),
    (lambda: seqlib.nn.GRU(3, 4)(mx.zeros((2, 5, 3)), mx.zeros((1, 4, 4))), ValueError, r"\(1, 5, 4\)"),
    (lambda: seqlib.nn.GRU(3, 4, num_layers=2)(mx.zeros((2, 5, 3)), mx.zeros((1, 5, 4))), ValueError, "hx"),
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((2, 5, 3)), mx.zeros((1, 5, 4))), TypeError, "tuple"),
    (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((2, 5, 3)), (mx.zeros((1, 5, 4)), mx.zeros((1, 5, 3)))),
     ValueError, r"c_0.*\(1, 5, 4\)"),
    (lambda: seqlib.nn.LSTM(3, 4, proj_size=2)(mx.zeros((2, 5, 3)), (mx.zeros((1, 5, 4)), mx.zeros((1, 5, 4)))),
     ValueError, r"h_0.*\(1, 5, 2\)"),
    (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((2, 3)), mx.zeros((1, 1, 4))), ValueError, r"\(1, 4\)"),
    (lambda: seqlib.nn.LSTM(3, 4, dropout=1.5), ValueError, r"dropout.*\[0, 1\]"),
    (lambda: seqlib.nn.LSTM(3, 4, dropout=-0.1), ValueError, "dropout"),
    (lambda: seqlib.nn.LSTM(3, 4, proj_size=4), ValueError, r"proj_size.*\[0, hidden_size=4\)"),
    (lambda: seqlib.nn.LSTM(3, 4, proj_size=-1), ValueError, "proj_size"),
    (lambda: seqlib.nn.RNN(3, 4, nonlinearity="sigmoid"), ValueError, "nonlinearity"),
    (lambda: seqlib.nn.GRU(0, 4), ValueError, "input_size"),
    (lambda: seqlib.nn.GRU(3, 4, num_layers=0), ValueError, "num_layers"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", BAD_CALLS)
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_torch_packed_sequence_is_refused_with_a_hint():
    packed = torch.nn.utils.rnn.pack_sequence([torch.zeros(2, 3), torch.zeros(1, 3)])
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.rnn\.PackedSequence.*pack_padded_sequence"):
        seqlib.nn.GRU(3, 4)(packed)


def test_packed_input_with_the_wrong_feature_size_is_refused():
    packed = packing.pack_sequence([mx.zeros((2, 5)), mx.zeros((1, 5))])
    with pytest.raises(ValueError, match=r"input\.data.*input_size=3"):
        seqlib.nn.GRU(3, 4)(packed)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_half_precision_layers_track_float32(kind, dtype):
    torch.manual_seed(0)
    ours = seqlib.from_torch(make_torch_layer(kind, 4, 8, num_layers=2, bidirectional=True))
    x = mx.random.normal((6, 3, 4))
    expected = np.array(ours(x)[0])
    ours.set_dtype(dtype)
    got = ours(x.astype(dtype))[0]
    assert got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected, atol=3e-2 if dtype == mx.bfloat16 else 5e-3)
