"""Malformed input to the small public helpers: seqlib.activations, seqlib.data, seqlib.notebook.below.

Each gives mx.tanh's / NumPy's result where those give one, or a clear error
naming the argument (see tests/isolated.py for the shared assertion).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from isolated import assert_clear_error, run_isolated

import seqlib
from seqlib.activations import fast_sigmoid, fast_tanh


def activation_of(name, value, dtype):
    function = {"tanh": fast_tanh, "sigmoid": fast_sigmoid}[name]
    dtypes = {"int32": mx.int32, "int64": mx.int64, "uint8": mx.uint8, "bool": mx.bool_}
    return function(mx.array(value, dtype=dtypes[dtype]) if dtype else value)


@given(
    name=st.sampled_from(["tanh", "sigmoid"]),
    values=st.lists(st.integers(-(2**31), 2**31 - 1) | st.booleans(), min_size=1, max_size=8),
    dtype=st.sampled_from(["int32", "int64", "uint8", "bool", None]),
)
def test_integer_and_bool_inputs_are_computed_in_float32_as_mx_tanh_does(name, values, dtype):
    if dtype == "uint8":
        values = [abs(int(v)) % 256 for v in values]
    elif dtype == "bool":
        values = [bool(v) for v in values]
    elif dtype == "int32" or dtype is None:
        values = [int(v) for v in values]
    got = activation_of(name, values, dtype)
    as_float = np.array(values, dtype=np.float64)
    expected = np.tanh(as_float) if name == "tanh" else 1 / (1 + np.exp(-np.clip(as_float, -700, 700)))
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), expected, atol=4e-7, rtol=0)


@pytest.mark.parametrize("value", [0.5, -3, [0.1, 2.0]])
def test_python_numbers_and_lists_work_like_mx_tanh(value):
    np.testing.assert_allclose(np.array(fast_tanh(value)), np.array(mx.tanh(mx.array(value))), atol=4e-7)


@pytest.mark.parametrize("function", [fast_tanh, fast_sigmoid])
@pytest.mark.parametrize("value", ["0.5", None, object(), mx.array([1 + 2j])])
def test_strings_objects_and_complex_are_refused(function, value):
    with pytest.raises(TypeError, match="x: expected"):
        function(value)


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_follow_tanh(special):
    got = np.array(fast_tanh(mx.array([special, 0.0])))
    np.testing.assert_array_equal(got, np.tanh(np.array([special, 0.0], np.float32)))


def adding_problem_of(num_sequences, length, rng):
    return seqlib.data.adding_problem(num_sequences, length, rng)


@pytest.mark.parametrize(
    ("num_sequences", "length", "rng", "named"),
    [
        (0, 10, 0, "num_sequences"),
        (-1, 10, 0, "num_sequences"),
        (2.5, 10, 0, "num_sequences"),
        (True, 10, 0, "num_sequences"),
        (2, 1, 0, "length"),
        (2, 0, 0, "length"),
        (2, "10", 0, "length"),
        (2, 10, "seed", "rng"),
        (2, 10, -1, "rng"),
    ],
)
def test_adding_problem_refuses_bad_sizes_and_seeds(num_sequences, length, rng, named):
    assert_clear_error(run_isolated(adding_problem_of, num_sequences, length, rng), named)


@given(num_sequences=st.integers(1, 5), length=st.integers(2, 40), seed=st.integers(0, 2**32))
def test_adding_problem_marks_one_step_in_each_half_and_sums_them(num_sequences, length, seed):
    inputs, targets = seqlib.data.adding_problem(num_sequences, length, seed)
    values, marks = np.array(inputs[..., 0]), np.array(inputs[..., 1])
    assert marks[:, : length // 2].sum(axis=1).tolist() == [1.0] * num_sequences
    assert marks[:, length // 2 :].sum(axis=1).tolist() == [1.0] * num_sequences
    np.testing.assert_allclose(np.array(targets), (values * marks).sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("max_files", [0, -2, 1.5, "3"])
def test_python_source_tokens_refuses_bad_max_files(max_files):
    with pytest.raises((ValueError, TypeError), match="max_files"):
        seqlib.data.python_source_tokens(max_files)


def reference_cell(kind, shapes, nonlinearity="tanh"):
    arrays = [np.zeros(shape) for shape in shapes]
    if kind == "lstm":
        x, h, *params = arrays
        return seqlib.reference.lstm_cell(x, h, h, *params)
    cell = {"rnn": seqlib.reference.rnn_cell, "gru": seqlib.reference.gru_cell}[kind]
    return cell(*arrays, nonlinearity=nonlinearity) if kind == "rnn" else cell(*arrays)


GOOD = {"rnn": 1, "lstm": 4, "gru": 3}  # gate blocks


def good_shapes(kind, batch=2, inputs=3, hidden=5):
    rows = GOOD[kind] * hidden
    return [(batch, inputs), (batch, hidden), (rows, inputs), (rows, hidden), (rows,), (rows,)]


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize(
    ("position", "shape", "named"),
    [(0, (2, 4), "x"), (0, (3,), "x"), (2, (4, 3), "weight_ih"), (1, (1, 5), "h"), (1, (5,), "h"), (4, (1,), "bias_ih"),
     (5, (7,), "bias_hh"), (3, (5,), "weight_hh")],
)  # fmt: skip
def test_reference_cells_name_the_argument_whose_shape_is_wrong(kind, position, shape, named):
    shapes = good_shapes(kind)
    shapes[position] = shape
    with pytest.raises(ValueError, match=named):
        reference_cell(kind, shapes)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_reference_cells_accept_torchs_layout(kind):
    assert reference_cell(kind, good_shapes(kind))[0].shape[-1] == 5


@pytest.mark.parametrize("nonlinearity", ["Tanh", "sigmoid", None])
def test_an_unknown_nonlinearity_is_refused_not_read_as_relu(nonlinearity):
    with pytest.raises(ValueError, match="nonlinearity"):
        reference_cell("rnn", good_shapes("rnn"), nonlinearity)
    with pytest.raises(ValueError, match="nonlinearity"):
        seqlib.reference.rnn_cell_scalar(0.5, 0.1, 1.0, 1.0, 0.0, 0.0, nonlinearity)
