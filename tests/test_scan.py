"""seqlib.scan's two paths: inference (no transformation traces the call) and training (a custom function).

The torch-parity tests (test_recurrent_layers.py, test_cells.py) check each path against
torch: forwards run the inference path, gradients the training path.  These tests pin what
holds between the two paths and the structure that keeps a layer's cost linear in T.
"""

import mlx.core as mx
import numpy as np
import pytest

from seqlib import kernels, pointwise, scan

PACKINGS = [(4,) * 9, (3, 3, 2, 1), (1,)]


def random(shape, seed, scale=0.5):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def lstm_arguments(batch_sizes, hidden_size=5, proj_size=0, seed=0):
    size = proj_size or hidden_size
    return (
        random((sum(batch_sizes), 4 * hidden_size), seed),
        random((4 * hidden_size, size), seed + 1),
        random((batch_sizes[0], size), seed + 2),
        random((batch_sizes[0], hidden_size), seed + 3),
    ), (random((proj_size, hidden_size), seed + 4),) if proj_size else ()


# Under a transformation the gate math runs eagerly with mx.tanh; the inference path runs it
# compiled with seqlib.activations.fast_tanh (at most a few 1e-7 away): hence the tolerance.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def traced_forward(function, *arguments):
    """function's outputs computed under mx.vjp: the training path."""
    outputs, _ = mx.vjp(lambda *a: function(*a), list(arguments), [mx.ones_like(o) for o in function(*arguments)])
    return outputs


@pytest.fixture(autouse=True)
def ops_backend():
    with kernels.use_backend("ops"):
        yield


def test_is_traced_tells_a_transformation_from_a_plain_call():
    x = mx.ones((2, 3))
    assert not pointwise.is_traced(x)
    seen = []

    def record(y):
        seen.append(pointwise.is_traced(x, y))
        return y.sum()

    mx.grad(record)(x)
    mx.vmap(lambda y: y * float(record(y) is not None))(x)
    mx.compile(record)(x)
    assert seen == [True, True, True]


@pytest.mark.parametrize("batch_sizes", PACKINGS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("proj_size", [0, 3])
def test_lstm_inference_equals_the_training_path(batch_sizes, reverse, proj_size):
    arguments, projection = lstm_arguments(batch_sizes, proj_size=proj_size)
    w_hr = projection[0] if projection else None
    inference = scan.lstm_sequence(*arguments, batch_sizes, reverse, w_hr)
    training = traced_forward(lambda *a: scan.lstm_sequence(*a, batch_sizes, reverse, w_hr), *arguments)
    for ours, theirs in zip(inference, training, strict=True):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), **TOLERANCE)


@pytest.mark.parametrize("batch_sizes", PACKINGS)
@pytest.mark.parametrize("reverse", [False, True])
def test_gru_and_rnn_inference_equal_the_training_path(batch_sizes, reverse):
    hidden_size, rows = 6, sum(batch_sizes)
    gru = (random((rows, 18), 1), random((18, 6), 2), random((18,), 3), random((batch_sizes[0], 6), 4))
    cases = [(lambda *a: scan.gru_sequence(*a, batch_sizes, reverse), gru)]
    for nonlinearity in ("tanh", "relu"):
        rnn = (random((rows, hidden_size), 5), random((hidden_size,) * 2, 6), random((batch_sizes[0], hidden_size), 7))
        cases.append((lambda *a, n=nonlinearity: scan.rnn_sequence(*a, batch_sizes, reverse, n), rnn))
    for function, arguments in cases:
        for ours, theirs in zip(function(*arguments), traced_forward(function, *arguments), strict=True):
            np.testing.assert_allclose(np.array(ours), np.array(theirs), **TOLERANCE)


@pytest.mark.parametrize("backend", ["ops", "plain", "emulate"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_an_input_bias_passed_apart_equals_one_added_first(backend, kind):
    """input_bias (the layers' b_ih (+ b_hh), passed beside x W_ih^T) gives what adding it to x_gates first gives,
    on every path (the "ops" backend runs the C++ primitives where they are built, "emulate" the Metal kernels),
    in inference and under a gradient, and its gradient is every row's gradient of x_gates."""
    batch_sizes, hidden_size = (3, 3, 2, 1), 6
    width = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind] * hidden_size
    product, bias = random((sum(batch_sizes), width), 1), random((width,), 2)
    w_hh, h0 = random((width, hidden_size), 3), random((3, hidden_size), 4)
    if kind == "LSTM":
        states, function = (h0, random((3, hidden_size), 5)), scan.lstm_sequence
    elif kind == "GRU":
        states, function = (random((width,), 6), h0), scan.gru_sequence
    else:
        states, function = (h0,), scan.rnn_sequence

    def run(x_gates, input_bias=None):
        return function(x_gates, w_hh, *states, batch_sizes, True, input_bias=input_bias)

    def loss(x_gates, input_bias=None):
        return sum((output * output).sum() for output in run(x_gates, input_bias))

    with kernels.use_backend(backend):
        for ours, theirs in zip(run(product, bias), run(product + bias), strict=True):
            np.testing.assert_allclose(np.array(ours), np.array(theirs), **TOLERANCE)
        d_product, d_bias = mx.grad(loss, argnums=(0, 1))(product, bias)
        d_x_gates = mx.grad(loss)(product + bias)
    np.testing.assert_allclose(np.array(d_product), np.array(d_x_gates), **TOLERANCE)
    np.testing.assert_allclose(np.array(d_bias), np.array(d_x_gates.sum(axis=0)), **TOLERANCE)
    with pytest.raises(ValueError, match="input_bias"):
        run(product, bias[:-1])


def test_the_training_path_has_a_fixed_number_of_outputs_whatever_the_length():
    # One output per step and kind made building the graph grow as T squared: keep them packed.
    for steps in (1, 50):
        batch_sizes = (2,) * steps
        (x_gates, w_hh, h0, c0), _ = lstm_arguments(batch_sizes)
        lstm = scan._lstm_sequence_function(batch_sizes, False, False, False)(x_gates, w_hh, h0, c0)
        gru = scan._gru_sequence_function(batch_sizes, False, False)(
            random((2 * steps, 15), 1), random((15, 5), 2), random((15,), 3), random((2, 5), 4)
        )
        rnn = scan._rnn_sequence_function(batch_sizes, False, "tanh", False)(
            random((2 * steps, 5), 1), random((5, 5), 2), random((2, 5), 3)
        )
        assert (len(lstm), len(gru), len(rnn)) == (7, 5, 3)
        assert lstm[3].shape == (2 * steps, 20)  # every step's activations, packed in time order
