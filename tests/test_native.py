"""seqlib.native: the C++ CPU primitives against the MLX-ops path, and the fallback when they cannot be built.

The layers' torch-parity tests (test_recurrent_layers.py, test_cells.py, test_streaming.py)
run on these primitives wherever they are available; here each primitive is compared with
seqlib.scan's MLX-ops path on the same arguments, packed and reversed, outputs, saved
arrays and gradients, and the build's fallback is exercised in a fresh interpreter.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlib import kernels, native, scan

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the primitives are built on Linux only")
# The ops path's custom function, traced by mx.vjp, runs its gate math with mx.tanh; the primitives use
# fast_tanh (within 3.8e-7): outputs agree to a few 1e-7, and weight gradients, sums over every row, to
# a few 1e-6 of the terms they add up.  Where the products sum in other orders, twelve steps of a recurrence carry
# the rounding on: on a 2-core Zen 5 with OpenBLAS's AVX2 ("Haswell") kernels against the packed loops' AVX-512
# tiles, GRUs at H = 48 and 64 differed by up to 5.0e-6 at one entry in 7,872 or 11,136 (values of 0.06-0.15).
TOLERANCE = {"rtol": 1e-5, "atol": 5e-6}
GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}


def recurrent_scale(hidden_size: int) -> float:
    """w_hh's scale: 0.5 up to 64 units, then shrinking as 1 / sqrt(H), so that a step's gain (and with it how
    far the recurrence carries one summation order's rounding away from another's) stays that of 64 units."""
    return 0.5 * min(1.0, (64 / hidden_size) ** 0.5)


def output_tolerance(hidden_size: int) -> dict:
    """TOLERANCE up to 64 units; past that the gradients' tolerance: a sum of H products rounds differently in
    another order (the packed loops' tiles against MLX's matmul), and the recurrence carries it on.  At H = 130
    both paths are within 7e-6 of a float64 GRU and differ from each other by up to 7e-6; a wrong row, unit
    or step would be off by tenths."""
    return TOLERANCE if hidden_size <= 64 else GRADIENT_TOLERANCE


def random(shape, seed, scale=0.5):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def packed_batch_sizes(lengths) -> tuple[int, ...]:
    """Rows per step of a packed batch of sequences of these lengths."""
    lengths = sorted(lengths, reverse=True)
    return tuple(sum(length > t for length in lengths) for t in range(lengths[0]))


def assert_close_at_scale(ours, theirs, tolerance, name=""):
    """Close within rtol, and within atol times the array's largest magnitude (at least 1): gradients that
    many steps have added up reach several units, and float32 rounding of other summation orders with them."""
    ours, theirs = np.array(ours), np.array(theirs)
    scale = max(1.0, float(np.abs(theirs).max())) if theirs.size else 1.0
    np.testing.assert_allclose(ours, theirs, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale, err_msg=name)


def ops_path_with_gradients(batch_sizes, reverse, arguments, cotangents):
    """seqlib.scan's MLX-ops custom function: its outputs, and the vjp of the first three."""
    function = scan._lstm_sequence_function(batch_sizes, reverse, False, False)
    outputs = function(*arguments)
    _, grads = mx.vjp(lambda *a: function(*a)[:3], list(arguments), cotangents)
    return outputs, grads


@linux_only
def test_the_primitives_are_built_and_used_on_linux():
    assert native.available(), native.reason()
    assert "checked" in native.reason()


@linux_only
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    hidden_size=st.integers(1, 40),
    reverse=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_forward_saved_arrays_and_backward_equal_the_ops_path(lengths, hidden_size, reverse, seed):
    check_lstm_against_the_ops_path(lengths, hidden_size, reverse, seed)


@linux_only
@pytest.mark.parametrize("hidden_size", [8, 20, 64, 130, 240])
@pytest.mark.parametrize("reverse", [False, True])
def test_long_sequences_of_many_rows_equal_the_ops_path(hidden_size, reverse):
    """Long enough and wide enough for every form of the forward loop: on AVX2 and AVX-512 the packed one (whole
    row tiles and partial ones, whole blocks of a vector of units (8 or 16) and a partial one, masked; at
    H = 240 a step's product passes 4M multiply-adds and a team of threads shares the blocks), and rows
    finishing (or, reversed, joining) at different steps."""
    lengths = [12] * 9 + [9] * 5 + [5] * 4 + [1]  # 19 sequences
    check_lstm_against_the_ops_path(lengths, hidden_size, reverse, seed=hidden_size)


@linux_only
@pytest.mark.parametrize("reverse", [False, True])
def test_a_wide_batch_of_few_units_equals_the_ops_path(reverse):
    """Many rows and few blocks of units: a step's product passes 4M multiply-adds (456 rows, H = 48) with fewer
    blocks than threads, so where there are spare threads (on AVX-512 with 2 cores or more: 3 blocks of 16) each
    block's rows are shared among threads (row_parts), each writing and reading its rows' saved blocks."""
    lengths = [6] * 300 + [4] * 150 + [1] * 6  # 456 sequences
    check_lstm_against_the_ops_path(lengths, 48, reverse, seed=48)


def check_lstm_against_the_ops_path(lengths, hidden_size, reverse, seed):
    batch_sizes = packed_batch_sizes(lengths)
    rows, batch = sum(batch_sizes), batch_sizes[0]
    w_hh = random((4 * hidden_size, hidden_size), seed + 1, recurrent_scale(hidden_size))
    arguments = [random((rows, 4 * hidden_size), seed, 1.0), w_hh,
                 random((batch, hidden_size), seed + 2), random((batch, hidden_size), seed + 3)]  # fmt: skip
    cotangents = [random((rows, hidden_size), seed + 4), random((batch, hidden_size), seed + 5),
                  random((batch, hidden_size), seed + 6)]  # fmt: skip
    with kernels.use_backend("ops"):
        want_outputs, want_grads = ops_path_with_gradients(batch_sizes, reverse, arguments, cotangents)
    extension = native.extension()
    outputs = extension.lstm_sequence(*arguments, batch_sizes, reverse, True)
    inference = extension.lstm_sequence(*arguments, batch_sizes, reverse, False)
    assert len(outputs) == 4 and len(inference) == 3
    # what the primitive saves for its backward (the activations and each step's c, in blocks of units: 5H floats
    # a row and at most a vector's more) is checked by the gradients below, which read it
    assert outputs[3].shape[0] == rows and 5 * hidden_size <= outputs[3].shape[1] < 5 * (hidden_size + 16)
    for ours, theirs in zip([*outputs[:3], *inference], [*want_outputs[:3], *want_outputs[:3]], strict=True):
        assert_close_at_scale(ours, theirs, output_tolerance(hidden_size))
    _, grads = mx.vjp(lambda *a: extension.lstm_sequence(*a, batch_sizes, reverse, True)[:3], arguments,
                      cotangents)  # fmt: skip  (the primitive's own vjp)
    for ours, theirs, name in zip(grads, want_grads, ["x_gates", "w_hh", "h0", "c0"], strict=True):
        assert_close_at_scale(ours, theirs, GRADIENT_TOLERANCE, name)


@linux_only
@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    hidden_size=st.integers(1, 40),
    reverse=st.booleans(),
    kind=st.sampled_from(["GRU", "RNN tanh", "RNN relu"]),
    seed=st.integers(0, 1000),
)
def test_gru_and_rnn_outputs_and_gradients_equal_the_ops_path(lengths, hidden_size, reverse, kind, seed):
    check_gru_or_rnn_against_the_ops_path(lengths, hidden_size, reverse, kind, seed)


@linux_only
@pytest.mark.parametrize("hidden_size", [8, 20, 64, 130, 240])
@pytest.mark.parametrize("reverse", [False, True])
def test_long_gru_sequences_of_many_rows_equal_the_ops_path(hidden_size, reverse):
    """As for the LSTM: every form of the GRU's forward loop, the OpenBLAS one for small steps and the packed
    one on a team of threads at H = 240, tiles and blocks whole and partial."""
    lengths = [12] * 9 + [9] * 5 + [5] * 4 + [1]  # 19 sequences
    check_gru_or_rnn_against_the_ops_path(lengths, hidden_size, reverse, "GRU", seed=hidden_size)


def check_gru_or_rnn_against_the_ops_path(lengths, hidden_size, reverse, kind, seed):
    batch_sizes = packed_batch_sizes(lengths)
    rows, batch = sum(batch_sizes), batch_sizes[0]
    blocks = 3 if kind == "GRU" else 1
    w_hh = random((blocks * hidden_size, hidden_size), seed + 1, recurrent_scale(hidden_size))
    arguments = [random((rows, blocks * hidden_size), seed, 1.0), w_hh]
    if kind == "GRU":
        arguments.append(random((3 * hidden_size,), seed + 2))
        ops = scan._gru_sequence_function(batch_sizes, reverse, False)
        ours = lambda *a: native.extension().gru_sequence(*a, list(batch_sizes), reverse, True)  # its own vjp
    else:
        nonlinearity = kind.split()[1]
        ops = scan._rnn_sequence_function(batch_sizes, reverse, nonlinearity, False)
        relu = nonlinearity == "relu"
        ours = lambda *a: native.extension().rnn_sequence(*a, list(batch_sizes), reverse, relu, True)  # its own vjp
    arguments.append(random((batch, hidden_size), seed + 3))
    cotangents = [random((rows, hidden_size), seed + 4), random((batch, hidden_size), seed + 5)]
    results = []
    for function in (ops, ours):
        with kernels.use_backend("ops"):
            outputs = function(*arguments)
            _, grads = mx.vjp(lambda *a, f=function: f(*a)[:2], arguments, cotangents)
        results.append((outputs, grads))
    (their_outputs, their_grads), (my_outputs, my_grads) = results
    # what the primitive saves for its backward (the GRU's activations and its hidden side's n part, in blocks
    # of units: 4H floats a row and at most a vector's more; the RNN nothing, its backward reads the output) is
    # checked by the gradients, which read it
    if kind == "GRU":
        assert len(my_outputs) == 3 and my_outputs[2].shape[0] == rows
        assert 4 * hidden_size <= my_outputs[2].shape[1] < 4 * (hidden_size + 16)
    else:
        assert len(my_outputs) == 2
    for position, (my, their) in enumerate(zip(my_outputs[:2], their_outputs[:2], strict=True)):
        assert_close_at_scale(my, their, output_tolerance(hidden_size), f"{kind} output {position}")
    for position, (my, their) in enumerate(zip(my_grads, their_grads, strict=True)):
        assert_close_at_scale(my, their, GRADIENT_TOLERANCE, f"{kind} gradient {position}")


def primitive_call(kind: str, batch_sizes, reverse: bool):
    """The primitive of kind (LSTM, GRU, RNN) as a function of its arrays, saving what its vjp needs."""
    extension, sizes = native.extension(), list(batch_sizes)
    if kind == "LSTM":
        return lambda x, w, h0, c0, **bias: extension.lstm_sequence(x, w, h0, c0, sizes, reverse, True, **bias)[:3]
    if kind == "GRU":
        return lambda x, w, b, h0, **bias: extension.gru_sequence(x, w, b, h0, sizes, reverse, True, **bias)[:2]
    return lambda x, w, h0, **bias: extension.rnn_sequence(x, w, h0, sizes, reverse, False, True, **bias)[:2]


@linux_only
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("hidden_size", [5, 64, 240])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("longest", [12, 3])
def test_a_bias_passed_apart_gives_the_bits_of_the_bias_added_first(kind, hidden_size, reverse, longest):
    """The layers pass x W_ih^T and its bias apart (the loops add the bias as they read each row): every loop
    gives the bits of x_gates with the bias added first (the OpenBLAS loops: every RNN, any sequence of fewer
    than 4 steps; the packed ones: the LSTM and the GRU from 4 steps), and the bias's gradient is every row's
    gradient of x_gates summed."""
    lengths = [longest] * 9 + [longest - 1] * 5 + [1]
    batch_sizes = packed_batch_sizes(lengths)
    rows, batch, seed = sum(batch_sizes), batch_sizes[0], hidden_size
    width = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind] * hidden_size
    product, bias = random((rows, width), seed, 1.0), random((width,), seed + 1)
    others = [random((width, hidden_size), seed + 2, recurrent_scale(hidden_size))]
    if kind == "GRU":
        others.append(random((width,), seed + 3))
    others += [random((batch, hidden_size), seed + 4 + k) for k in range(2 if kind == "LSTM" else 1)]
    call = primitive_call(kind, batch_sizes, reverse)
    together = call(product + bias, *others)
    apart = call(product, *others, bias=bias)
    for mine, theirs in zip(apart, together, strict=True):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))
    cotangents = [random(output.shape, seed + 9 + k) for k, output in enumerate(together)]
    _, (d_product, d_bias) = mx.vjp(lambda p, b: call(p, *others, bias=b), [product, bias], cotangents)
    _, (d_x_gates,) = mx.vjp(lambda x: call(x, *others), [product + bias], cotangents)
    np.testing.assert_array_equal(np.array(d_product), np.array(d_x_gates))
    assert_close_at_scale(d_bias, d_x_gates.sum(axis=0), TOLERANCE, "bias")


@linux_only
def test_a_bias_of_the_wrong_shape_is_refused():
    arguments = [random((6, 8), 1), random((8, 2), 2), random((3, 2), 3), random((3, 2), 4)]
    with pytest.raises(ValueError, match=r"lstm_sequence: expected bias float32 of shape \(8,\), got \(2,\)"):
        native.extension().lstm_sequence(*arguments, [3, 3], False, False, bias=random((2,), 5))


# (lengths of the sequences, D, H, whether the loop computes the input side) for scan.lstm_input_sequence and
# gru_input_sequence: the loop computes it where it runs packed (4 steps or more, AVX2) and D <= 8 B with AVX-512,
# 4 B with AVX2 (B the longest step's rows, here the number of sequences); else a matmul computes x_gates.
INPUT_CASES = [
    ([12] * 9 + [11] * 5 + [1], 56, 48, True),  # 15 sequences: D = 56 <= 60, blocks whole
    ([12] * 9 + [11] * 5 + [1], 7, 37, True),  # a partial block of units, D below a vector
    ([6] * 40, 130, 70, True),  # D past a depth chunk of the tiles (128)
    ([9] * 8 + [4] * 3, 20, 40, True),  # partial blocks of the weight gradients' rows, narrow and wide
    ([7] * 2 + [3], 12, 300, True),  # small batch, wide: a team of threads shares the blocks
    ([5] * 33 + [3] * 2, 20, 230, True),  # 35 rows a step, w_hh's gradient too large: the loop takes the input side's
    ([6] * 32, 24, 230, True),  # the same with every step full (w_hh's gradient from slices of the output)
    ([5] * 4, 200, 16, False),  # D > 8 B: a matmul, then the loop on x_gates
    ([3] * 16, 32, 32, False),  # too few steps to pack: a matmul, then OpenBLAS's loop
]


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists the vector extension `flag` (seqlib's C++ is built with -march=native)."""
    try:
        with open("/proc/cpuinfo") as file:
            return f" {flag} " in file.read().replace("\n", " ") + " "
    except OSError:
        return False


needs_packed_loops = pytest.mark.skipif(not cpu_has("avx2"), reason="the packed loops need AVX2 and FMA")


# For each kind given its input: its gates, its states, the sequence function given the input and the one given
# x_gates, each (x, w_ih, w_hh, *states, bias) -> outputs.
INPUT_KINDS = {
    "lstm": (4, ("h0", "c0"),
             lambda b, r: lambda x, w_ih, w_hh, h0, c0, bias=None: scan.lstm_input_sequence(
                 x, w_ih, w_hh, h0, c0, b, r, input_bias=bias),
             lambda b, r: lambda x, w_ih, w_hh, h0, c0, bias=None: scan.lstm_sequence(
                 x @ w_ih.T, w_hh, h0, c0, b, r, input_bias=bias)),
    "gru": (3, ("b_hh", "h0"),
            lambda b, r: lambda x, w_ih, w_hh, b_hh, h0, bias=None: scan.gru_input_sequence(
                x, w_ih, w_hh, b_hh, h0, b, r, input_bias=bias),
            lambda b, r: lambda x, w_ih, w_hh, b_hh, h0, bias=None: scan.gru_sequence(
                x @ w_ih.T, w_hh, b_hh, h0, b, r, input_bias=bias)),
}  # fmt: skip


def graph_of(output: mx.array, tmp_path) -> str:
    """output's graph in DOT: the names of the primitives that compute it."""
    mx.export_to_dot(str(tmp_path / "graph.dot"), output)
    return (tmp_path / "graph.dot").read_text()


def input_kind_states(kind: str, batch: int, hidden_size: int, seed: int) -> list[mx.array]:
    """The arrays after w_hh of a sequence given its input: the LSTM's h0, c0; the GRU's b_hh, h0."""
    names = INPUT_KINDS[kind][1]
    return [random((3 * hidden_size,) if name == "b_hh" else (batch, hidden_size), seed + i)
            for i, name in enumerate(names)]  # fmt: skip


@linux_only
@pytest.mark.parametrize("case", INPUT_CASES, ids=lambda case: f"T{max(case[0])}-D{case[1]}-H{case[2]}")
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_layer_given_its_input_equals_one_given_its_input_product(kind, case, reverse, with_bias, tmp_path):
    """scan.lstm_input_sequence(x, w_ih, ...) is scan.lstm_sequence(x @ w_ih.T, ...), and gru_input_sequence is
    gru_sequence so: outputs, and the gradients of every argument (x's and w_ih's from the loop's d_x_gates).
    Where the loop computes the input side (no matmul in the forward's graph: checked) it adds x_t's product and
    h's as x_gates and h's product are added, so the two agree to float32 rounding (on this machine to the bit,
    where OpenBLAS sums x @ w_ih.T in the order of k)."""
    gates, state_names, given_input_of, given_product_of = INPUT_KINDS[kind]
    lengths, input_size, hidden_size, computed_in_the_loop = case
    batch_sizes = packed_batch_sizes(lengths)
    rows, batch, seed = sum(batch_sizes), batch_sizes[0], input_size + hidden_size
    arguments = [random((rows, input_size), seed, 1.0), random((gates * hidden_size, input_size), seed + 1, 0.3),
                 random((gates * hidden_size, hidden_size), seed + 2, recurrent_scale(hidden_size)),
                 *input_kind_states(kind, batch, hidden_size, seed + 3)]  # fmt: skip
    bias = random((gates * hidden_size,), seed + 5) if with_bias else None
    cotangents = [random((rows, hidden_size), seed + 6), random((batch, hidden_size), seed + 7),
                  random((batch, hidden_size), seed + 8)][: 3 if kind == "lstm" else 2]
    given_input, given_product = given_input_of(batch_sizes, reverse), given_product_of(batch_sizes, reverse)
    primals = arguments + ([bias] if with_bias else [])
    outputs, grads = mx.vjp(given_input, primals, cotangents)
    want_outputs, want_grads = mx.vjp(given_product, primals, cotangents)
    output_names = ["output", "h_n", "c_n"][: len(cotangents)]
    names = [*output_names, *["d_x", "d_w_ih", "d_w_hh", *(f"d_{n}" for n in state_names), "d_bias"][: len(primals)]]
    for name, mine, theirs in zip(names, [*outputs, *grads], [*want_outputs, *want_grads], strict=True):
        assert_close_at_scale(mine, theirs, TOLERANCE, name)
    inference = given_input(*primals)  # outside the vjp: saves nothing
    graph = graph_of(inference[0], tmp_path)  # before evaluating it, which leaves the array alone
    assert ("LSTMSequence" if kind == "lstm" else "GRUSequence") in graph
    if cpu_has("avx2"):  # where the packed loops run
        assert ("Matmul" not in graph) == computed_in_the_loop
    for mine, theirs in zip(inference, want_outputs, strict=True):
        assert_close_at_scale(mine, theirs, TOLERANCE)


@linux_only
@needs_packed_loops
@pytest.mark.parametrize(("input_size", "computed_in_the_loop"), [(64, True), (66, False)])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_loop_computes_its_input_side_only_where_the_input_is_narrow(kind, input_size, computed_in_the_loop,
                                                                          tmp_path):  # fmt: skip
    """At 8 rows a step the loop takes x @ w_ih.T itself up to D = 64 with AVX-512, 32 with AVX2 (no matmul in the
    graph); past it, a matmul."""
    gates, _, given_input_of, _ = INPUT_KINDS[kind]
    batch, hidden_size, steps = 8, 32, 6
    if not cpu_has("avx512f"):
        input_size //= 2
    x = random((steps * batch, input_size), 1)
    w_ih = random((gates * hidden_size, input_size), 2, 0.2)
    w_hh = random((gates * hidden_size, hidden_size), 3, 0.2)
    output = given_input_of([batch] * steps, False)(x, w_ih, w_hh, *input_kind_states(kind, batch, hidden_size, 4))[0]
    graph = graph_of(output, tmp_path)
    assert ("LSTMSequence" if kind == "lstm" else "GRUSequence") in graph
    assert ("Matmul" not in graph) == computed_in_the_loop


@linux_only
@needs_packed_loops
@pytest.mark.parametrize(("batch", "hidden_size", "in_the_loop"),
                         [(8, 32, "all"), (32, 224, "input side"), (8, 224, "none")])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_backward_takes_the_input_sides_gradients_only_where_they_are_small(kind, batch, hidden_size, in_the_loop,
                                                                                tmp_path):  # fmt: skip
    """Where the forward computed its input side, the backward's loop takes d_x, d_w_ih, d_w_hh and the biases'
    gradients itself while those fit 512 KB (G H (D + H) floats: no matmul in their graph); else, at 32 rows a step
    and more, d_x, d_w_ih and the biases' while those fit (G H D floats), d_w_hh then a product after the loop;
    else the vjp's matmuls after the loop.  The bias's gradient is summed in the loop every way (no sum in its
    graph); all agree with the layer given its input product, with x's gradient asked for or not (x is data: the
    loop skips d_x)."""
    gates, _, given_input_of, given_product_of = INPUT_KINDS[kind]
    input_size, steps = 32, 6  # D <= 4 B: the forward computes its input side on AVX2 and AVX-512
    batch_sizes = [batch] * (steps - 1) + [batch - 3]
    rows = sum(batch_sizes)
    arguments = [random((rows, input_size), 1), random((gates * hidden_size, input_size), 2, 0.2),
                 random((gates * hidden_size, hidden_size), 3, recurrent_scale(hidden_size)),
                 *input_kind_states(kind, batch, hidden_size, 4), random((gates * hidden_size,), 6)]  # fmt: skip
    cotangent = random((rows, hidden_size), 7)

    def loss(function):
        return lambda *arguments: (function(batch_sizes, False)(*arguments)[0] * cotangent).sum()

    assert "Matmul" not in graph_of(given_input_of(batch_sizes, False)(*arguments)[0], tmp_path)  # the input side
    argnums = tuple(range(len(arguments)))
    grads = mx.grad(loss(given_input_of), argnums)(*arguments)
    graph = graph_of(grads[1], tmp_path)  # d_w_ih, read before it is evaluated
    assert ("LSTMSequenceBackward" if kind == "lstm" else "GRUSequenceBackward") in graph
    assert ("Matmul" not in graph) == (in_the_loop != "none")
    assert ("Matmul" not in graph_of(grads[2], tmp_path)) == (in_the_loop == "all")  # d_w_hh
    assert "Sum" not in graph_of(grads[-1], tmp_path)  # the bias's gradient
    want = mx.grad(loss(given_product_of), argnums)(*arguments)
    for name, mine, theirs in zip(["d_x", "d_w_ih", "d_w_hh", "d_state0", "d_state1", "d_bias"], grads, want,
                                  strict=True):  # fmt: skip
        assert_close_at_scale(mine, theirs, TOLERANCE, name)
    weights_only = mx.grad(loss(given_input_of), argnums[1:])(*arguments)
    for name, mine, theirs in zip(["d_w_ih", "d_w_hh", "d_state0", "d_state1", "d_bias"], weights_only, want[1:],
                                  strict=True):  # fmt: skip
        assert_close_at_scale(mine, theirs, TOLERANCE, name)


@linux_only
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_layer_given_its_input_refuses_arguments_that_do_not_fit(kind):
    gates, _, given_input_of, _ = INPUT_KINDS[kind]
    run = given_input_of([3] * 4, False)
    x, w_hh = random((12, 5), 1), random((gates * 2, 2), 2)
    states = input_kind_states(kind, 3, 2, 3)
    with pytest.raises(ValueError, match=rf"w_ih: expected shape \({gates * 2}, 5\), got \({gates * 2}, 4\)"):
        run(x, random((gates * 2, 4), 4), w_hh, *states)
    with pytest.raises(ValueError, match=r"x: expected shape \(\*, \*\)"):
        run(x.reshape(4, 3, 5), random((gates * 2, 5), 4), w_hh, *states)
    with pytest.raises(TypeError, match=r"w_ih: expected dtype mlx.core.float32 .*, got mlx.core.float16"):
        run(x, random((gates * 2, 5), 4).astype(mx.float16), w_hh, *states)
    with pytest.raises(ValueError, match=r"batch_sizes"):
        given_input_of([3] * 3, False)(x, random((gates * 2, 5), 4), w_hh, *states)
    with pytest.raises(ValueError, match=r"input_bias: expected shape"):
        run(x, random((gates * 2, 5), 4), w_hh, *states, random((gates,), 5))
    extension, op = native.extension(), f"{kind}_input_sequence"  # the binding checks as well
    binding = getattr(extension, op)
    call = (lambda x, w_ih: binding(x, w_ih, w_hh, *states, [3] * 4, False, False))
    with pytest.raises(ValueError, match=rf"{op}: expected x of shape \(N, D\), got \(4, 3, 5\)"):
        call(x.reshape(4, 3, 5), random((gates * 2, 5), 4))
    with pytest.raises(ValueError, match=rf"{op}: expected w_ih float32 of shape \({gates * 2}, 5\)"):
        call(x, random((gates * 2, 4), 4))
    for batch_sizes in ([3] * 4, [4] * 3):  # the loop's input side, and (3 steps) the matmul before the loop
        with pytest.raises(ValueError, match=rf"{op}: expected bias float32 of shape \({gates * 2},\)"):
            binding(x, random((gates * 2, 5), 4), w_hh, *input_kind_states(kind, batch_sizes[0], 2, 3), batch_sizes,
                    False, False, random((gates,), 5))


@linux_only
def test_non_contiguous_arguments_are_read_as_their_values():
    x_gates = random((8, 12), 1).T.T  # a view
    w_hh_transposed = random((3, 12), 2).T  # (12, 3), column-major
    h0, c0 = random((6, 3), 3)[::2], random((3, 3), 4)
    ours = native.extension().lstm_sequence(x_gates, w_hh_transposed, h0, c0, [3, 3, 2], False, False)
    with kernels.use_backend("ops"):
        want = scan._lstm_inference(x_gates, mx.array(np.array(w_hh_transposed)), mx.array(np.array(h0)), c0,
                                    scan._steps((3, 3, 2), False), None)  # fmt: skip
    for mine, theirs in zip(ours, want, strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), **TOLERANCE)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


FALLBACK = """
    import warnings, seqlib, mlx.core as mx
    from seqlib import native
    layer = seqlib.nn.LSTM(3, 4)
    output, _ = layer(mx.ones((5, 2, 3)))
    mx.eval(output)
    print(native.available(), "|", native.reason())
"""


@linux_only
def test_without_a_compiler_the_ops_path_runs_with_one_clear_warning(tmp_path):
    """MLX upgraded since the install (the libraries built then do not fit) and no compiler to build anew."""
    no_prebuilt = FALLBACK.replace("from seqlib import native",
                                   "from seqlib import native, _build\n    _build.prebuilt = lambda library, key: None")
    result = run_python(no_prebuilt, CXX="/bin/false", CC="/bin/false", SEQLIB_CACHE_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("False |")
    warnings = [line for line in result.stderr.splitlines() if "NativeWarning" in line]
    assert len(warnings) == 1 and "MLX-ops path runs" in warnings[0]


@linux_only
def test_the_environment_variable_turns_the_primitives_off_silently():
    result = run_python(FALLBACK, SEQLIB_NATIVE="0")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "SEQLIB_NATIVE=0" in result.stdout


# ----------------------------------------------------------------- embedding bags

def ops_path_bag(*args, **kwargs):
    """F.embedding_bag on the MLX-ops path (the native primitive switched off for this call)."""
    from seqlib import functional

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional, "_native_serves", lambda weight, indices: False)
        return functional.embedding_bag(*args, **kwargs)


def bag_value_and_grads(bag_function, weight, indices, offsets, cotangent, per_sample_weights, **options):
    """The pooled bags and the gradients of sum(pooled * cotangent) w.r.t. the weight (and the entry weights)."""
    def loss(weight, *entry_weights):
        pooled = bag_function(indices, weight, offsets, per_sample_weights=(entry_weights or (None,))[0], **options)
        return (pooled * cotangent).sum(), pooled

    arguments = [weight] if per_sample_weights is None else [weight, per_sample_weights]
    (_, pooled), grads = mx.value_and_grad(loss, argnums=tuple(range(len(arguments))))(*arguments)
    return [pooled, *grads]


@linux_only
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    num_embeddings=st.integers(1, 12),
    embedding_dim=st.integers(1, 150),  # past one and two 64-column tiles
    mode=st.sampled_from(["sum", "mean", "max"]),
    weighted=st.booleans(),
    padding=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_bag_pooling_and_its_gradients_equal_the_ops_path(
    lengths, num_embeddings, embedding_dim, mode, weighted, padding, seed
):
    from seqlib import functional

    rng = np.random.default_rng(seed)
    indices = mx.array(rng.integers(0, num_embeddings, size=sum(lengths)).astype(np.int32))
    offsets = mx.array(np.cumsum([0, *lengths[:-1]]).astype(np.int32))
    weight = random((num_embeddings, embedding_dim), seed + 1, 1.0)
    if mode == "max" and seed % 3 == 0:  # ties: the first entry must win, forward and backward
        weight = mx.round(weight)
    cotangent = random((len(lengths), embedding_dim), seed + 2, 1.0)
    per_sample_weights = random((indices.size,), seed + 3, 1.0) if weighted and mode == "sum" else None
    options = {"mode": mode, "padding_idx": int(rng.integers(0, num_embeddings)) if padding else None}
    arguments = (weight, indices, offsets, cotangent, per_sample_weights)
    ours = bag_value_and_grads(functional.embedding_bag, *arguments, **options)
    theirs = bag_value_and_grads(ops_path_bag, *arguments, **options)
    for position, (mine, want) in enumerate(zip(ours, theirs, strict=True)):
        np.testing.assert_allclose(np.array(mine), np.array(want), rtol=1e-6, atol=1e-6, err_msg=f"result {position}")
    inference = functional.embedding_bag(indices, weight, offsets, per_sample_weights=per_sample_weights, **options)
    np.testing.assert_array_equal(np.array(inference), np.array(ours[0]))  # untraced: the same primitive


BIG_BAGS = """
    import mlx.core as mx, numpy as np, sys
    from seqlib import functional
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 20, size=3000)
    indices = mx.array(rng.integers(0, 5000, size=int(lengths.sum())).astype(np.int32))
    offsets = mx.array(np.cumsum([0, *lengths[:-1]]).astype(np.int32))
    weight = mx.array(rng.standard_normal((5000, 72)).astype(np.float32))
    entry_weights = mx.array(rng.standard_normal(indices.size).astype(np.float32))
    results = []
    for mode, psw in (("mean", None), ("max", None), ("sum", entry_weights)):
        loss = lambda w, p: (functional.embedding_bag(indices, w, offsets, mode=mode, per_sample_weights=p,
                                                      padding_idx=7) ** 2).sum()
        arguments = (weight, psw) if psw is not None else (weight,)
        grads = mx.grad(lambda *a: loss(a[0], a[1] if len(a) > 1 else None), argnums=tuple(range(len(arguments))))(
            *arguments)
        results += [functional.embedding_bag(indices, weight, offsets, mode=mode, per_sample_weights=psw), *grads]
    np.savez(sys.argv[1], *[np.array(r) for r in results])
"""


def assert_every_thread_count_gives_the_same_bits(script: str, tmp_path, counts=("1", "2", "3", "4")) -> None:
    """Run ``script`` (which saves its results to the .npz named by its argument) once per OMP_NUM_THREADS in
    ``counts`` (seqlib's loops use at most that many, and no more than the process may run on) and compare."""
    files = []
    for threads in counts:
        path = tmp_path / f"threads{threads}.npz"
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(path)], capture_output=True,
                                text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": threads})  # fmt: skip
        assert result.returncode == 0, result.stderr
        files.append(np.load(path))
    for other in files[1:]:
        for key in files[0].files:
            np.testing.assert_array_equal(files[0][key], other[key], err_msg=key)


@linux_only
def test_bags_split_over_threads_add_in_the_same_order_as_one_thread(tmp_path):
    """Large enough for several threads: every thread count gives bit-identical pools and gradients."""
    assert_every_thread_count_gives_the_same_bits(BIG_BAGS, tmp_path)


# (steps, batch, H) whose loops run on teams of threads: a step's product passes 4M multiply-adds, and its blocks
# of units are fewer than twice the threads (H = 32, 48 on AVX-512) or not (H = 128, 512), so teams split rows,
# blocks or both: rows alone where the weights fit in half a core's L2 (H = 128 on any current x86 core), blocks where
# they do not (H = 512: 4 MB); or, at small batches, w_hh passes 256 KB (H = 256, 128), and teams split blocks.
# (The small batches' loops are short: the first in the script may run on one thread while the workers sleep, the
# others, called in quick succession, on teams: see team_of.)
LARGE_STEPS = ((6, 1030, 32), (5, 800, 48), (5, 200, 128), (5, 48, 512))
SMALL_BATCHES = ((6, 1, 256), (5, 3, 128))
BIG_STEPS = """
    import mlx.core as mx, numpy as np, sys
    from seqlib import native
    rng = np.random.default_rng(0)
    extension, results = native.extension(), []
    for steps, batch, hidden in {shapes}:
        batch_sizes = [batch] * (steps - 2) + [max(batch - 7, 1), max(batch // 2, 1)]
        rows = sum(batch_sizes)
        for gates in {gate_counts}:
            function = extension.lstm_sequence if gates == 4 else extension.gru_sequence
            arrays = [rng.standard_normal(shape).astype(np.float32) * scale for shape, scale in (
                ((rows, gates * hidden), 1.0), ((gates * hidden, hidden), hidden ** -0.5), ((gates * hidden,), 0.1),
                ((batch, hidden), 1.0), ((batch, hidden), 1.0))]
            x_gates, w_hh, b_hh, h0, c0 = map(mx.array, arrays)
            states = (h0, c0) if gates == 4 else (b_hh, h0)
            for reverse in (False, True):
                run = lambda x, w: function(x, w, *states, batch_sizes, reverse, True)
                outputs = run(x_gates, w_hh)
                _, grads = mx.vjp(lambda x, w: run(x, w)[:2], [x_gates, w_hh], [mx.ones_like(o) for o in outputs[:2]])
                results += [*outputs, *grads]
    np.savez(sys.argv[1], *[np.array(r) for r in results])
"""

INPUT_STEPS = """
    import mlx.core as mx, numpy as np, sys
    from seqlib import scan
    rng = np.random.default_rng(0)
    results = []
    for (steps, batch, hidden, input_size), gates in [(s, g) for s in {shapes} for g in (4, 3)]:  # D <= 4 B: the
        batch_sizes = [batch] * (steps - 2) + [max(batch - 7, 1), max(batch // 2, 1)]  # loops compute the input side
        rows = sum(batch_sizes)
        width = gates * hidden
        x, w_ih, w_hh, bias, h0, c0 = (mx.array(rng.standard_normal(shape).astype(np.float32) * scale) for shape, scale
                                       in (((rows, input_size), 1.0), ((width, input_size), input_size ** -0.5),
                                           ((width, hidden), hidden ** -0.5), ((width,), 0.1),
                                           ((batch, hidden), 1.0), ((batch, hidden), 1.0)))
        b_hh = bias[::-1] + 0  # the GRU's
        for reverse in (False, True):
            if gates == 4:
                run = lambda x, w_ih, w_hh, bias, b_hh: scan.lstm_input_sequence(x, w_ih, w_hh, h0, c0, batch_sizes,
                                                                                  reverse, input_bias=bias)
            else:
                run = lambda x, w_ih, w_hh, bias, b_hh: scan.gru_input_sequence(x, w_ih, w_hh, b_hh, h0, batch_sizes,
                                                                                 reverse, input_bias=bias)
            primals = [x, w_ih, w_hh, bias, b_hh]
            outputs, grads = mx.vjp(run, primals, [mx.ones_like(o) for o in run(*primals)])
            results += [*outputs, *grads, *run(*primals)]
    np.savez(sys.argv[1], *[np.array(r) for r in results])
"""

WIDE_STEPS = """
    import mlx.core as mx, numpy as np, sys
    import seqlib
    mx.random.seed(0)  # the layers' weights
    rng = np.random.default_rng(0)
    results = []
    for kind, input_size, hidden_size in (("LSTM", 640, 640), ("GRU", 320, 576), ("RNN", 700, 600)):
        layer = getattr(seqlib.nn, kind)(input_size, hidden_size, num_layers=2)
        state = None
        for _ in range(3):  # batch 1: every layer's products shared among a team of threads
            output, state = layer.step(mx.array(rng.standard_normal((1, input_size)).astype(np.float32)), state)
            results += [output, *(state if isinstance(state, tuple) else (state,))]
    np.savez(sys.argv[1], *[np.array(r) for r in results])
"""


@linux_only
def test_a_step_at_batch_1_shared_among_threads_gives_the_bits_of_one_thread(tmp_path):
    """At batch 1 a step's matrix-vector products share the weights' rows among a team: each output entry is summed
    by one thread in one order, so every thread count gives the same outputs and states."""
    assert_every_thread_count_gives_the_same_bits(WIDE_STEPS, tmp_path)


QUANTIZED_WIDE_STEPS = """
    import mlx.core as mx, numpy as np, sys
    import seqlib
    mx.random.seed(0)  # the modules' weights
    rng = np.random.default_rng(0)
    results = []
    for kind, input_size, hidden_size, bits, group_size in (("LSTMCell", 640, 640, 8, 64),
                                                            ("GRUCell", 320, 576, 4, 32),
                                                            ("LSTM", 384, 640, 8, 128)):
        module = getattr(seqlib.nn, kind)(input_size, hidden_size).to_quantized(group_size=group_size, bits=bits)
        state = None
        for _ in range(3):
            x = mx.array(rng.standard_normal((1, input_size)).astype(np.float32))
            if kind.endswith("Cell"):
                state = module(x, state)
            else:
                output, state = module.step(x, state)
                results.append(output)
            results += list(state) if isinstance(state, tuple) else [state]
    np.savez(sys.argv[1], *[np.array(r) for r in results])
"""


@linux_only
def test_a_quantized_step_shared_among_threads_gives_the_bits_of_one_thread(tmp_path):
    """The quantized step's rows are shared among a team as the float step's, taken 8 (AVX-512) or 4 at a time
    from where each thread's rows start: a row sums in one order whichever rows it is taken with, so every thread
    count gives the same outputs and states.  (With 3 threads or more, some threads' rows end in a block of 4 at
    these widths; with 2, every split falls on a multiple of 32 rows.)"""
    assert_every_thread_count_gives_the_same_bits(QUANTIZED_WIDE_STEPS, tmp_path)

CONCURRENT_LOOPS = """
    import threading, numpy as np, mlx.core as mx
    from seqlib import native
    extension, rng = native.extension(), np.random.default_rng(0)
    steps, batch, hidden = 6, 1030, 32  # a team of threads (LARGE_STEPS)
    x_gates = mx.array(rng.standard_normal((steps * batch, 4 * hidden)).astype(np.float32))
    w_hh = mx.array(rng.standard_normal((4 * hidden, hidden)).astype(np.float32) * hidden ** -0.5)
    h0 = c0 = mx.zeros((batch, hidden))
    run = lambda: np.array(extension.lstm_sequence(x_gates, w_hh, h0, c0, [batch] * steps, False, False)[0])
    want, results = run(), {}

    def on_a_stream(i):
        with mx.stream(mx.new_stream(mx.cpu)):
            results[i] = [run() for _ in range(20)]

    threads = [threading.Thread(target=on_a_stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and all(np.array_equal(r, want) for runs in results.values() for r in runs)
"""


@linux_only
def test_loops_on_several_streams_at_once_share_the_workers_or_start_their_own():
    """Three MLX streams run teams of threads at the same time: one has the kept workers, the others start
    threads of their own; none waits on another's, and each gives the bits of a lone call."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CONCURRENT_LOOPS)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "4"})  # fmt: skip
    assert result.returncode == 0, result.stderr


@linux_only
def test_packed_loops_shared_among_threads_give_the_bits_of_one_thread(tmp_path):
    """The packed forward loops share a step's blocks of units among threads, and where those are too few for the
    threads, its rows too; each output's products add in the same order whichever thread computes it, so every
    thread count (1 to 4; more where the machine has them) gives the same outputs, saved arrays and gradients.
    So do the LSTM's and the GRU's loops that compute their input side (D <= 4 B: at batch 1, D = 4), and their
    backward loops that take the input side's gradients (weights and biases) too, with w_hh's or (the last shape)
    without."""
    counts = ("1", "2", "3", "4", "16")
    assert_every_thread_count_gives_the_same_bits(BIG_STEPS.format(shapes=LARGE_STEPS, gate_counts=(4, 3)), tmp_path,
                                                  counts=counts)  # fmt: skip
    assert_every_thread_count_gives_the_same_bits(BIG_STEPS.format(shapes=SMALL_BATCHES, gate_counts=(4,)), tmp_path,
                                                  counts=counts)  # fmt: skip
    assert_every_thread_count_gives_the_same_bits(BIG_STEPS.format(shapes=SMALL_BATCHES, gate_counts=(3,)), tmp_path,
                                                  counts=counts[1:])  # fmt: skip
    input_shapes = [(*shape, min(4 * shape[1], 96)) for shape in LARGE_STEPS + SMALL_BATCHES]
    input_shapes.append((5, 48, 256, 32))  # B >= 32, w_hh's gradient too large: the loop takes the input side's alone
    assert_every_thread_count_gives_the_same_bits(INPUT_STEPS.format(shapes=input_shapes), tmp_path, counts=counts)


@linux_only
def test_the_bag_backward_of_a_table_without_columns_gives_zero_entry_weight_gradients():
    """D = 0: nothing to scatter, and each entry weight's gradient is an empty dot product, 0."""
    extension = native.extension()
    indices, bounds, entry_weights = mx.array([1, 0, 1]), mx.array([0, 2, 3]), mx.array([0.5, -1.0, 2.0])
    for rows in (2, 0):
        if rows == 0:
            indices, bounds, entry_weights = mx.zeros((0,), mx.int32), mx.array([0, 0, 0]), mx.zeros((0,))
        d_table, d_weights = extension.bag_pool_backward(mx.zeros((2, 0)), mx.zeros((rows, 0)), indices, bounds,
                                                         entry_weights, 0, -1)  # fmt: skip
        assert d_table.shape == (rows, 0)
        np.testing.assert_array_equal(np.array(d_weights), np.zeros(entry_weights.shape, np.float32))


@linux_only
def test_the_bag_primitive_refuses_arrays_of_other_kinds():
    extension = native.extension()
    weight, bounds = mx.zeros((4, 3)), mx.array([0, 2])
    with pytest.raises(ValueError, match="int32"):
        extension.bag_pool(weight, mx.array([1, 2], mx.int64), bounds, None, 0, -1)
    with pytest.raises(ValueError, match="float32"):
        extension.bag_pool(weight.astype(mx.float16), mx.array([1, 2]), bounds, None, 0, -1)
    with pytest.raises(ValueError, match="cotangent"):
        extension.bag_pool_backward(mx.zeros((2, 3)), weight, mx.array([1, 2]), bounds, None, 0, -1)


HOST_INDEX_DTYPES = [mx.int8, mx.uint8, mx.int16, mx.uint16, mx.int32, mx.uint32, mx.int64, mx.uint64]


@linux_only
@given(st.lists(st.integers(-3, 12), max_size=12), st.lists(st.integers(-2, 14), max_size=6),
       st.sampled_from(HOST_INDEX_DTYPES), st.sampled_from(HOST_INDEX_DTYPES), st.booleans(), st.integers(0, 10))
@settings(max_examples=300, deadline=None)
def test_the_host_bag_check_passes_what_the_python_checks_pass(ids, offsets, id_dtype, offset_dtype, last, rows):
    """host_bag_bounds gives bag_bounds' int32 bounds where check_index_range and bag_bounds pass, else None
    (then Python raises its own message): never a layout that Python refuses, whatever the dtypes."""
    from seqlib._bags import bag_bounds
    from seqlib._checks import check_index_range

    signed = not mx.issubdtype(id_dtype, mx.unsignedinteger), not mx.issubdtype(offset_dtype, mx.unsignedinteger)
    ids = [i for i in ids if signed[0] or i >= 0]
    offsets = [o for o in offsets if signed[1] or o >= 0]
    indices, offsets_array = mx.array(ids, id_dtype), mx.array(offsets, offset_dtype)
    try:
        check_index_range(np.array(indices), rows, "input")
        expected = bag_bounds(np.array(offsets_array), len(ids), last, np.int32)
    except (IndexError, ValueError):
        expected = None
    bounds = native.extension().host_bag_bounds(indices, offsets_array, rows, last)
    if bounds is None:
        assert expected is None or len(offsets) == 0  # empty offsets: left to Python, which gives no bags
    else:
        assert expected is not None and bounds.dtype == mx.int32
        np.testing.assert_array_equal(np.array(bounds), expected)


@linux_only
def test_the_host_bag_check_leaves_what_it_cannot_read_to_python():
    extension = native.extension()
    ids, offsets = mx.array([1, 2, 3]), mx.array([0, 1])
    assert np.array(extension.host_bag_bounds(ids, offsets, 4, False)).tolist() == [0, 1, 3]
    strided = mx.array([0, 1, 5, 1])[::2]
    mx.eval(strided)  # a view of every other element, offsets [0, 5] past the input: read as it lies, [0, 1]
    for indices, offs in ((ids + 0, offsets), (ids, offsets + 0),  # lazy: not evaluated yet
                          (mx.array([[1, 2, 3]]), offsets), (ids, strided),  # not 1-D, not contiguous
                          (mx.array([1.0, 2.0]), offsets), (ids, mx.array([0.0, 1.0]))):  # not integers
        assert extension.host_bag_bounds(indices, offs, 4, False) is None
    huge = mx.array(np.array([2**63 + 1], np.uint64))  # beyond int64: no wrap to a negative or small row
    assert extension.host_bag_bounds(huge, mx.array([0]), 4, False) is None


@linux_only
def test_take_rows_copies_rows_bit_for_bit():
    """seqlib.sparse gathers a batch's rows with it: NaN, infinities and -0.0 must come through unchanged."""
    table = mx.array(np.array([[1.5, -0.0], [np.nan, np.inf], [-np.inf, 2.0]], np.float32))
    rows = native.extension().take_rows(table, mx.array([2, 0, 2, 1]))
    want = np.array(table)[[2, 0, 2, 1]]
    assert np.array(rows).tobytes() == want.tobytes()
    large = random((3000, 70), 5)
    picks = mx.array(np.random.default_rng(1).integers(0, 3000, 20000).astype(np.int32))  # several threads
    assert np.array_equal(np.array(native.extension().take_rows(large, picks)), np.array(large)[np.array(picks)])


@linux_only
def test_take_rows_written_past_the_caches_keeps_every_bit():
    """An output larger than the threads' L2 (64 MB here: up to 32 cores of 2 MB) is written with non-temporal
    stores where the build has AVX: rows of every width start anywhere within a cache line, and lines shared by two
    rows, the partial ones at either end of each, must come through as whole as the rest."""
    rng = np.random.default_rng(2)
    for width in (3, 16, 17, 301):
        table = rng.standard_normal((1000, width)).astype(np.float32)
        table.view(np.uint32)[:, 0] = 0x7FC00001 + np.arange(1000, dtype=np.uint32)  # NaNs with payloads
        picks = rng.integers(0, 1000, (64 << 20) // (4 * width)).astype(np.int32)
        rows = native.extension().take_rows(mx.array(table), mx.array(picks))
        assert np.array(rows).tobytes() == table[picks].tobytes(), width


@linux_only
@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=2, max_size=4), strided=st.booleans(), seed=st.integers(0, 1000))
def test_a_batch_first_input_is_copied_time_major_bit_for_bit(shape, strided, seed):
    """scan.time_major on the native path copies x.swapaxes(0, 1) with SwapLeadingAxes, bit for bit, for any shape
    (empty axes too) and from a strided view; its gradient is the cotangent swapped back, under mx.grad, mx.vmap and
    mx.compile(shapeless=True) alike."""
    x = random([2 * shape[0], *shape[1:]], seed)
    x = x[::2] if strided else x[: shape[0]]
    want = np.swapaxes(np.array(x), 0, 1)
    copied = scan.time_major(x)
    assert copied.shape == want.shape and np.array(copied).tobytes() == want.tobytes()
    cotangent = random(want.shape, seed + 1)
    grad = mx.grad(lambda x: (scan.time_major(x) * cotangent).sum())(x)
    np.testing.assert_array_equal(np.array(grad), np.swapaxes(np.array(cotangent), 0, 1))
    if x.ndim > 2:
        mapped = mx.vmap(scan.time_major)(x)
        np.testing.assert_array_equal(np.array(mapped), np.swapaxes(np.array(x), 1, 2))
    compiled = mx.compile(lambda x: scan.time_major(x) * 2, shapeless=True)
    np.testing.assert_array_equal(np.array(compiled(x)), want * 2)


@linux_only
@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=2, max_size=4), strided=st.booleans(), seed=st.integers(0, 1000))
def test_a_time_major_output_is_viewed_batch_first_and_its_gradient_copied_bit_for_bit(shape, strided, seed):
    """scan.batch_first on the native path is the view x.swapaxes(0, 1), of any shape (empty axes too) and of a
    strided view; its gradient is the cotangent swapped back, copied row-contiguous by SwapLeadingAxes, under mx.grad,
    mx.vjp, mx.jvp, mx.vmap and mx.compile(shapeless=True) alike."""
    x = random([2 * shape[0], *shape[1:]], seed)
    x = x[::2] if strided else x[: shape[0]]
    want = np.swapaxes(np.array(x), 0, 1)
    viewed = scan.batch_first(x)
    assert viewed.shape == want.shape and np.array(viewed).tobytes() == np.ascontiguousarray(want).tobytes()
    assert np.array(scan.batch_first(x) + 0).tobytes() == np.ascontiguousarray(want).tobytes()  # read by an op
    cotangent = random(want.shape, seed + 1)
    swapped_back = np.ascontiguousarray(np.swapaxes(np.array(cotangent), 0, 1))
    grad = mx.grad(lambda x: (scan.batch_first(x) * cotangent).sum())(x)
    assert np.array(grad).tobytes() == swapped_back.tobytes()
    _, (vjp,) = mx.vjp(scan.batch_first, [x], [cotangent])
    assert np.array(vjp).tobytes() == swapped_back.tobytes()
    _, (jvp,) = mx.jvp(scan.batch_first, [x], [x * 2])
    np.testing.assert_array_equal(np.array(jvp), want * 2)
    if x.ndim > 2:
        mapped = mx.vmap(scan.batch_first)(x)
        np.testing.assert_array_equal(np.array(mapped), np.swapaxes(np.array(x), 1, 2))
        row_cotangent = random((x.shape[2], x.shape[1], *x.shape[3:]), seed + 2)
        mapped_grad = mx.vmap(mx.grad(lambda row: (scan.batch_first(row) * row_cotangent).sum()))(x)
        np.testing.assert_array_equal(
            np.array(mapped_grad), np.broadcast_to(np.swapaxes(np.array(row_cotangent), 0, 1), x.shape)
        )
    if x.size > 0:  # an empty one comes back (1, ...) from MLX's own swapaxes too, under a shapeless compile
        compiled = mx.compile(mx.grad(lambda x: (scan.batch_first(x) * cotangent).sum()), shapeless=True)
        np.testing.assert_array_equal(np.array(compiled(x)), swapped_back)


@linux_only
def test_a_batch_first_layers_output_gradient_is_copied_on_threads_and_matches_the_time_major_layers():
    """A batch_first layer's output is scan.batch_first's view: its backward reads the cotangent through
    SwapLeadingAxes (not MLX's one-thread copy), and every gradient matches the time-major layer's bit for bit."""
    import seqlib

    layer = seqlib.nn.GRU(8, 16, batch_first=True)
    x, cotangent = random((3, 40, 8), 1), random((3, 40, 16), 2)

    def loss(parameters, x, batch_first):
        layer.update(parameters)
        layer.batch_first = batch_first
        try:
            output = layer(x if batch_first else x.swapaxes(0, 1))[0]
        finally:
            layer.batch_first = True
        return (output * (cotangent if batch_first else cotangent.swapaxes(0, 1))).sum()

    grads = [mx.grad(loss, argnums=(0, 1))(layer.trainable_parameters(), x, first) for first in (True, False)]
    with tempfile.TemporaryDirectory() as folder:  # before anything is evaluated
        mx.export_to_dot(os.path.join(folder, "backward.dot"), grads[0][1])
        mx.export_to_dot(os.path.join(folder, "forward.dot"), layer(x)[0])
        backward, forward = (open(os.path.join(folder, f"{name}.dot")).read() for name in ("backward", "forward"))
    assert backward.count("SwapLeadingAxes") == 2  # x and the cotangent
    assert "SwappedView" in forward and "Transpose" not in forward
    for ours, theirs in zip(*(tree_flatten(grad) for grad in grads), strict=True):
        assert ours[0] == theirs[0] and np.array(ours[1]).tobytes() == np.array(theirs[1]).tobytes()
    with pytest.raises(ValueError, match="time_major float32 with at least 2 axes, got \\(3,\\)"):
        native.extension().swapped_view(mx.zeros((3,)))


@linux_only
def test_the_time_major_copy_keeps_every_bit_on_many_threads_and_refuses_misfits():
    x = random((64, 200, 128), 3)  # 6.5 MB: a team of threads
    x = mx.where(mx.arange(128) == 5, mx.array(float("nan")), mx.where(mx.arange(128) == 6, mx.array(-0.0), x))
    copied = native.extension().swap_leading_axes(x)
    assert np.array(copied).tobytes() == np.ascontiguousarray(np.swapaxes(np.array(x), 0, 1)).tobytes()
    with tempfile.TemporaryDirectory() as folder:  # a batch_first layer reads its input through it
        import seqlib

        layer = seqlib.nn.LSTM(128, 8, batch_first=True)
        mx.export_to_dot(os.path.join(folder, "graph.dot"), layer(x[:2, :3])[0])
        assert "SwapLeadingAxes" in open(os.path.join(folder, "graph.dot")).read()
    with pytest.raises(ValueError, match="x float32 with at least 2 axes, got \\(3,\\)"):
        native.extension().swap_leading_axes(mx.zeros((3,)))
    with pytest.raises(ValueError, match="not float32"):
        native.extension().swap_leading_axes(mx.zeros((3, 2), mx.float16))
    with pytest.raises(TypeError):
        native.extension().swap_leading_axes(np.zeros((3, 2), np.float32))


@linux_only
@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), padding=st.booleans(), by_freq=st.booleans(),
       lazy=st.booleans(), seed=st.integers(0, 1000))
def test_a_lookup_gathers_in_the_primitive_and_its_gradient_adds_every_row(shape, padding, by_freq, lazy, seed):
    """seqlib.functional.embedding on the native path reads rows with TakeRows (MLX's CPU gather moves one float at a
    time); its values equal mx.take's bit for bit and its table gradient the scatter-add's, for any shape of ids,
    with padding_idx and scale_grad_by_freq, from evaluated ids (checked on the host) and lazy ones (in the graph)."""
    from seqlib import functional

    rng = np.random.default_rng(seed)
    table = random((7, 5), seed)
    ids = mx.array(rng.integers(0, 7, shape).astype(np.int64))
    ids = ids + 0 if lazy else ids
    cotangent = random((*shape, 5), seed + 1)
    options = dict(padding_idx=3 if padding else None, scale_grad_by_freq=by_freq)

    def value_and_grad():
        def loss(weight):
            return mx.sum(functional.embedding(ids, weight, **options) * cotangent)
        return functional.embedding(ids, table, **options), mx.grad(loss)(table)

    rows, grad = value_and_grad()
    with tempfile.TemporaryDirectory() as folder:  # the graph, before evaluation detaches it
        mx.export_to_dot(os.path.join(folder, "graph.dot"), rows)
        assert "TakeRows" in open(os.path.join(folder, "graph.dot")).read()
    with kernels.use_backend("plain"):  # mx.take and its scatter-add vjp
        want_rows, want_grad = value_and_grad()
    assert np.array(rows).tobytes() == np.array(want_rows).tobytes()
    np.testing.assert_allclose(np.array(grad), np.array(want_grad), rtol=1e-6, atol=1e-6)


@linux_only
def test_the_step_primitives_refuse_arrays_that_do_not_fit():
    """The layers pass checked arrays; a direct call with a misfit gets a ValueError, not a wild read."""
    extension = native.extension()
    x, h = mx.zeros((2, 3)), mx.zeros((2, 4))
    weights = [mx.zeros((16, 3)), mx.zeros((16, 4)), None, None]
    mx.eval(extension.lstm_step(x, h, h, weights))  # fits
    with pytest.raises(ValueError, match="w_hh"):
        extension.lstm_step(x, h, h, [weights[0], mx.zeros((16, 5)), None, None])
    with pytest.raises(ValueError, match="b_ih"):
        extension.lstm_step(x, h, h, [*weights[:2], mx.zeros(15), None])
    with pytest.raises(ValueError, match="batch"):
        extension.gru_step(mx.zeros((3, 3)), h, [mx.zeros((12, 3)), mx.zeros((12, 4)), None, None])
    with pytest.raises(ValueError, match="each layer"):
        extension.rnn_step(x, mx.zeros((2, 2, 4)), [mx.zeros((4, 3)), mx.zeros((4, 4)), None, None], False)
    with pytest.raises(ValueError, match="float32"):
        extension.rnn_step(x.astype(mx.float16), h, [mx.zeros((4, 3)), mx.zeros((4, 4)), None, None], False)


@linux_only
def test_vmap_runs_the_primitives_and_unsupported_transformations_say_so():
    from seqlib import functional

    import seqlib

    ids, offsets = mx.array([1, 2, 3, 4]), mx.array([0, 2])
    tables = random((3, 6, 4), 7)
    mapped = mx.vmap(lambda table: functional.embedding_bag(ids, table, offsets, mode="sum"))(tables)
    one_by_one = mx.stack([functional.embedding_bag(ids, table, offsets, mode="sum") for table in tables])
    np.testing.assert_array_equal(np.array(mapped), np.array(one_by_one))
    layer, x = seqlib.nn.GRU(4, 5), random((3, 2, 4), 8)
    mapped = mx.vmap(lambda x: layer(x)[0])(x)
    np.testing.assert_array_equal(np.array(mapped), np.array(mx.stack([layer(x_k)[0] for x_k in x])))
    with pytest.raises(ValueError, match=r"mx\.jvp .*SEQLIB_NATIVE=0"):
        mx.eval(mx.jvp(lambda table: functional.embedding_bag(ids, table, offsets), [tables[0]], [tables[0]]))
    with pytest.raises(ValueError, match=r"second derivative.*SEQLIB_NATIVE=0"):
        inner = mx.grad(lambda table: (functional.embedding_bag(ids, table, offsets, mode="sum") ** 3).sum())
        mx.eval(mx.grad(lambda table: inner(table).sum())(tables[0]))
