"""Malformed input for packed sequences, the recurrent layers and cells, seqlib.scan and the recurrent kernels.

Every public callable of seqlib.nn.utils.rnn, seqlib.nn.RNN/LSTM/GRU, RNNCell/LSTMCell/GRUCell,
seqlib.scan and the recurrent seqlib.kernels wrappers is thrown bad arguments, and must
either give torch's result (computed here on the same data) or raise a clear error (a
ValueError/IndexError/TypeError naming the argument, not MLX's own message).  Cases whose
indices or batch sizes could reach a gather or a kernel unchecked run in a child process
(tests/isolated.py), so an out-of-bounds read fails one test instead of killing the run.
Modules and kernels run on both backends: "ops" (MLX ops) and "metal" (the kernels, in the
C++ emulation of Metal).

Ported from PyTorch's test/nn/test_packed_sequence.py: test_total_length (-1, 0 and
max - 1 refused, extra padding), test_wrong_order, test_pad_sequence_with_tensor_sequences,
test_pad_sequence_with_non_iterable_sequences and the error cases of test_pack_padded_sequence
(unsorted lengths, empty tensors); from test/test_nn.py: test_RNN_cell_forward_zero_hidden_size
and test_RNN_cell_no_broadcasting (bad input and hx shapes for the cells).
"""

import mlx.core as mx
import mlx.nn
import mlx.utils
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from isolated import CLEAR_ERRORS, Outcome, assert_clear_error, run_isolated
from emulated import metal_backend

import seqlib
from seqlib import kernels, pointwise, scan
from seqlib.nn.utils import rnn
from seqlib.nn.utils.rnn import PackedSequence

BACKENDS = ("ops", "metal")
LAYERS = ("RNN", "LSTM", "GRU")
CELLS = ("RNNCell", "LSTMCell", "GRUCell")
TOLERANCE = {"rtol": 2e-5, "atol": 2e-6}


def on_backend(name: str):
    return metal_backend() if name == "metal" else kernels.use_backend("ops")


def in_process(call, *args, **kwargs) -> Outcome:
    """Run ``call`` here and report it as run_isolated would (for cases no index can reach a gather in)."""
    try:
        return Outcome("returned", value=call(*args, **kwargs))
    except Exception as error:
        bases = tuple(base.__name__ for base in CLEAR_ERRORS if isinstance(error, base))
        return Outcome("raised", error_type=type(error).__name__, error_bases=bases, message=str(error))


def torch_module(kind: str, *sizes, seed: int = 0, **options):
    torch.manual_seed(seed)
    if kind == "RNN_relu":
        return torch.nn.RNN(*sizes, nonlinearity="relu", **options)
    if kind == "RNNCell_relu":
        return torch.nn.RNNCell(*sizes, nonlinearity="relu", **options)
    return getattr(torch.nn, kind)(*sizes, **options)


def module_pair(kind: str, *sizes, seed: int = 0, **options):
    theirs = torch_module(kind, *sizes, seed=seed, **options)
    return seqlib.from_torch(theirs), theirs


def as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    if isinstance(value, mx.array):
        return np.array(value.astype(mx.float32) if value.dtype == mx.bfloat16 else value)
    return np.asarray(value)


def assert_same(ours, theirs, **tolerance):
    """Same shapes and values (NaN where torch has NaN), through tuples and PackedSequences."""
    if isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs)
        for mine, their in zip(ours, theirs, strict=True):
            assert_same(mine, their, **tolerance)
        return
    ours, theirs = as_numpy(ours), as_numpy(theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    np.testing.assert_allclose(ours, theirs, equal_nan=True, **(tolerance or TOLERANCE))


# ================================================================= hand-built PackedSequences
#
# data has 6 rows, 2 features; the well-formed version is batch_sizes [3, 2, 1] (lengths 3, 2, 1).

GOOD_SIZES = [3, 2, 1]
BAD_PACKED = {
    # name: (batch_sizes, sorted_indices, unsorted_indices, what the message names)
    "sorted_indices past the end": (GOOD_SIZES, [0, 1, 7], None, "sorted_indices"),
    "sorted_indices far past the end": (GOOD_SIZES, [0, 1, 1 << 30], None, "sorted_indices"),
    "sorted_indices negative": (GOOD_SIZES, [0, -1, 2], None, "sorted_indices"),
    "unsorted_indices past the end": (GOOD_SIZES, [0, 1, 2], [0, 1, 9], "unsorted_indices"),
    "unsorted_indices only, out of range": (GOOD_SIZES, None, [0, 1, 1 << 20], "unsorted_indices"),
    "unsorted_indices negative": (GOOD_SIZES, [0, 1, 2], [0, 1, -1], "unsorted_indices"),
    "indices 2-D": (GOOD_SIZES, [[0, 1, 2]], [[0, 1, 2]], "sorted_indices"),
    "indices float": (GOOD_SIZES, [0.0, 1.0, 2.0], [0, 1, 2], "sorted_indices"),
    "indices too short": (GOOD_SIZES, [0, 1], [0, 1], "sorted_indices"),
    "indices too long": (GOOD_SIZES, [0, 1, 2, 3], [0, 1, 2, 3], "sorted_indices"),
    "indices not a permutation": (GOOD_SIZES, [0, 0, 1], [0, 1, 2], "sorted_indices"),
    "unsorted not the inverse": (GOOD_SIZES, [1, 2, 0], [1, 2, 0], "inverse"),
    "batch_sizes increase": ([2, 3, 1], None, None, "batch_sizes"),
    "batch_sizes hold 0": ([3, 3, 0], None, None, "batch_sizes"),
    "batch_sizes negative": ([4, 3, -1], None, None, "batch_sizes"),
    "batch_sizes float": ([3.0, 2.0, 1.0], None, None, "batch_sizes"),
    "batch_sizes 2-D": ([[3, 2, 1]], None, None, "batch_sizes"),
    "batch_sizes sum short of the rows": ([3, 2], None, None, "batch_sizes"),
    "batch_sizes sum past the rows": ([3, 2, 2], None, None, "batch_sizes"),
    "batch_sizes sum far past the rows": ([3, 3, 3, 3, 3, 3, 3, 3], None, None, "batch_sizes"),
    "batch_sizes empty": ([], None, None, "batch_sizes"),
}
# PackedSequence.lengths() is left unchecked: chapter 7 prints the class's source (it reads NumPy copies, no gather)
CONSUMERS = ("pad_packed_sequence", "unpack_sequence", "RNN", "LSTM", "GRU")
# (consumer, backend): only the layers have a Metal path
CONSUMER_BACKENDS = [(consumer, "ops") for consumer in CONSUMERS] + [(layer, "metal") for layer in LAYERS]


def index_array(values):
    if values is None:
        return None
    values = np.asarray(values)
    return mx.array(values.astype(np.int64) if values.size == 0 else values)


def hand_packed(batch_sizes, sorted_indices, unsorted_indices, rows: int = 6, features: int = 2):
    data = mx.array(np.arange(rows * features, dtype=np.float32).reshape(rows, features))
    return PackedSequence(data, index_array(batch_sizes), index_array(sorted_indices), index_array(unsorted_indices))


def consume_packed(consumer, backend, batch_sizes, sorted_indices, unsorted_indices, rows=6, features=2):
    packed = hand_packed(batch_sizes, sorted_indices, unsorted_indices, rows, features)
    with on_backend(backend):
        if consumer == "pad_packed_sequence":
            return rnn.pad_packed_sequence(packed, total_length=None)
        if consumer == "unpack_sequence":
            return rnn.unpack_sequence(packed)
        output, state = getattr(seqlib.nn, consumer)(features, 3)(packed)
        mx.eval(output.data, state)
        return output.data, state


@pytest.mark.parametrize(("consumer", "backend"), CONSUMER_BACKENDS)
@pytest.mark.parametrize("case", list(BAD_PACKED))
def test_a_malformed_packed_sequence_is_refused_by_every_consumer_before_any_gather(case, consumer, backend):
    batch_sizes, sorted_indices, unsorted_indices, names = BAD_PACKED[case]
    outcome = run_isolated(consume_packed, consumer, backend, batch_sizes, sorted_indices, unsorted_indices)
    assert_clear_error(outcome, names, case=f"{case} -> {consumer}")


def test_out_of_range_indices_are_an_index_error_naming_the_range():
    outcome = run_isolated(consume_packed, "pad_packed_sequence", "ops", GOOD_SIZES, [0, 1, 7], None)
    assert_clear_error(outcome, "sorted_indices", "[0, 3)", "7", allowed=(IndexError,))


def test_a_torch_packed_sequence_or_a_plain_tuple_is_refused_with_a_hint():
    packed = torch.nn.utils.rnn.pack_sequence([torch.zeros(2, 3), torch.zeros(1, 3)])
    for consumer in (rnn.pad_packed_sequence, rnn.unpack_sequence, seqlib.nn.LSTM(3, 4)):
        assert_clear_error(in_process(consumer, packed), "seqlib.nn.utils.rnn.PackedSequence", "pack_padded_sequence")
    assert_clear_error(in_process(rnn.pad_packed_sequence, (mx.zeros((3, 1)), mx.array([1, 1, 1]))), "PackedSequence")
    bad_data = PackedSequence(np.zeros((3, 2), np.float32), mx.array([1, 1, 1]))
    assert_clear_error(in_process(rnn.pad_packed_sequence, bad_data), "sequence.data", "ndarray")
    scalar_data = PackedSequence(mx.array(1.0), mx.array([1]))
    assert_clear_error(in_process(rnn.unpack_sequence, scalar_data), "data", "at least 1 dimension")


@st.composite
def mutated_packed_batches(draw):
    """A well-formed packed batch (lengths drawn), then perhaps one field spoiled."""
    lengths = sorted(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)), reverse=True)
    batch = len(lengths)
    sizes = [sum(length > t for length in lengths) for t in range(lengths[0])]
    order = draw(st.permutations(range(batch))) if draw(st.booleans()) else None
    sorted_indices = None if order is None else list(order)
    unsorted_indices = None if order is None else np.argsort(order).tolist()
    mutation = draw(st.sampled_from(["none", "size", "append", "drop", "index", "duplicate", "drop_one"]))
    if mutation == "size":
        where = draw(st.integers(0, len(sizes) - 1))
        sizes[where] += draw(st.sampled_from([-2, -1, 1, 2]))
    elif mutation == "append":
        sizes.append(draw(st.integers(-1, batch + 1)))
    elif mutation == "drop" and len(sizes) > 1:
        sizes.pop(draw(st.integers(0, len(sizes) - 1)))
    elif mutation in ("index", "duplicate") and order is not None:
        field = draw(st.sampled_from([sorted_indices, unsorted_indices]))
        where = draw(st.integers(0, batch - 1))
        field[where] = draw(st.integers(-3, batch + 3)) if mutation == "index" else field[(where + 1) % batch]
    elif mutation == "drop_one" and order is not None:
        draw(st.sampled_from([sorted_indices, unsorted_indices])).pop()
    return sum(lengths), sizes, sorted_indices, unsorted_indices


def is_well_formed(rows, sizes, sorted_indices, unsorted_indices) -> bool:
    """The definition, independently of seqlib: sizes non-increasing, >= 1, adding up to the rows; the
    index arrays (both or neither here) inverse permutations of range(sizes[0])."""
    sizes = np.asarray(sizes)
    if sizes.size == 0 or sizes.min() < 1 or np.any(np.diff(sizes) > 0) or sizes.sum() != rows:
        return False
    if sorted_indices is None:
        return True
    batch = int(sizes[0])
    for field in (sorted_indices, unsorted_indices):
        if sorted(field) != list(range(batch)):
            return False
    return list(np.asarray(sorted_indices)[unsorted_indices]) == list(range(batch))


@settings(max_examples=40)
@given(mutated_packed_batches())
def test_a_hand_built_packed_sequence_gives_torchs_padding_or_a_clear_error(case):
    rows, sizes, sorted_indices, unsorted_indices = case
    outcome = run_isolated(consume_packed, "pad_packed_sequence", "ops", sizes, sorted_indices, unsorted_indices, rows)
    if not is_well_formed(rows, sizes, sorted_indices, unsorted_indices):
        assert_clear_error(outcome, case=case)
        return
    assert outcome.kind == "returned", str(outcome)
    data = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    indices = [None if field is None else torch.tensor(field) for field in (sorted_indices, unsorted_indices)]
    torch_packed = torch.nn.utils.rnn.PackedSequence(data, torch.tensor(sizes), *indices)
    theirs = torch.nn.utils.rnn.pad_packed_sequence(torch_packed)
    assert_same(outcome.value, theirs)


def test_sorted_indices_alone_get_their_inverse_as_in_torch():
    ours = rnn.check_packed_sequence(hand_packed(GOOD_SIZES, [2, 0, 1], None))
    theirs = torch.nn.utils.rnn.PackedSequence(torch.zeros(6, 2), torch.tensor(GOOD_SIZES), torch.tensor([2, 0, 1]))
    assert np.array(ours.unsorted_indices).tolist() == theirs.unsorted_indices.tolist()
    layer, torch_layer = module_pair("GRU", 2, 3)
    packed = hand_packed(GOOD_SIZES, [2, 0, 1], None)
    h0 = np.random.default_rng(0).normal(size=(1, 3, 3)).astype(np.float32)
    ours = layer(packed, mx.array(h0))
    torch_packed = torch.nn.utils.rnn.PackedSequence(
        torch.arange(12, dtype=torch.float32).reshape(6, 2), torch.tensor(GOOD_SIZES), torch.tensor([2, 0, 1])
    )
    theirs = torch_layer(torch_packed, torch.tensor(h0))
    assert_same((ours[0].data, ours[1]), (theirs[0].data, theirs[1]), rtol=1e-5, atol=1e-6)


# ================================================================= dtypes

WRONG_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float64": mx.float64, "int32": mx.int32,
                "complex64": mx.complex64}  # fmt: skip


def layer_or_cell(kind, input_size=3, hidden_size=4):
    return getattr(seqlib.nn, kind)(input_size, hidden_size)


def input_for(kind, dtype=mx.float32):
    shape = (2, 3) if kind in CELLS else (5, 2, 3)
    return mx.ones(shape).astype(dtype)


def states_for(kind, dtypes):
    shape = (2, 4) if kind in CELLS else (1, 2, 4)
    states = [mx.zeros(shape, dtype) for dtype in dtypes]
    return tuple(states) if kind.startswith("LSTM") else states[0]


@pytest.mark.parametrize("dtype", list(WRONG_DTYPES))
@pytest.mark.parametrize("kind", LAYERS + CELLS)
def test_input_of_another_dtype_than_the_layer_is_a_type_error(kind, dtype):
    outcome = in_process(layer_or_cell(kind), input_for(kind, WRONG_DTYPES[dtype]))
    assert_clear_error(outcome, "input", "float32", dtype, allowed=(TypeError,), case=kind)


@pytest.mark.parametrize("kind", LAYERS)
def test_packed_data_of_another_dtype_is_a_type_error(kind):
    packed = rnn.pack_sequence([mx.ones((3, 3), mx.float16), mx.ones((2, 3), mx.float16)])
    outcome = in_process(layer_or_cell(kind), packed)
    assert_clear_error(outcome, "input.data", "float32", "float16", allowed=(TypeError,))


@pytest.mark.parametrize("dtype", ["float16", "float64", "int32"])
@pytest.mark.parametrize(("kind", "position"), [(kind, 0) for kind in LAYERS + CELLS] + [("LSTM", 1), ("LSTMCell", 1)])
def test_a_state_of_another_dtype_is_a_type_error_naming_it(kind, dtype, position):
    dtypes = [mx.float32, mx.float32]
    dtypes[position] = WRONG_DTYPES[dtype]
    name = {("LSTM", 0): "h_0", ("LSTM", 1): "c_0", ("LSTMCell", 0): "hx[0]", ("LSTMCell", 1): "hx[1]"}
    outcome = in_process(layer_or_cell(kind), input_for(kind), states_for(kind, dtypes))
    assert_clear_error(outcome, name.get((kind, position), "hx"), "float32", dtype, allowed=(TypeError,), case=kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kind", LAYERS + CELLS)
def test_half_precision_modules_still_take_their_own_dtype(kind, dtype, backend):
    module = layer_or_cell(kind)
    expected = module(input_for(kind), states_for(kind, [mx.float32] * 2))
    module.set_dtype(dtype)
    with on_backend(backend):
        got = module(input_for(kind, dtype), states_for(kind, [dtype] * 2))
    for mine, reference in zip(mlx.utils.tree_flatten(got), mlx.utils.tree_flatten(expected), strict=True):
        assert mine[1].dtype == dtype
        np.testing.assert_allclose(as_numpy(mine[1]), as_numpy(reference[1]), atol=3e-2)
    half_layer = layer_or_cell(kind)
    half_layer.set_dtype(dtype)
    assert_clear_error(in_process(half_layer, input_for(kind)), "input", str(dtype).split(".")[-1], "float32")


# ================================================================= NaN and infinities, on both backends

NAN_KINDS = ("RNN", "RNN_relu", "LSTM", "GRU", "RNNCell", "RNNCell_relu", "LSTMCell", "GRUCell")


def nan_input(kind, seed=0, batch=3):
    rng = np.random.default_rng(seed)
    shape = (batch + 1, 3) if "Cell" in kind else (4, batch, 3)
    x = rng.normal(0, 2, shape).astype(np.float32)
    x.reshape(-1, 3)[[1, 5 % x.reshape(-1, 3).shape[0]], 0] = np.nan  # NaN in two rows, one feature
    x.reshape(-1, 3)[2, 1] = np.inf
    x.reshape(-1, 3)[3, 2] = -np.inf
    return x


# batch 3: the whole-sequence kernels (B <= 8); batch 9: one cell kernel per step
@pytest.mark.parametrize("batch", [3, 1 + kernels.SEQUENCE_KERNEL_MAX_BATCH])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", NAN_KINDS)
def test_nan_and_inf_inputs_propagate_as_in_torch(kind, backend, batch):
    ours, theirs = module_pair(kind, 3, 5)
    x = nan_input(kind, batch=batch)
    with on_backend(backend):
        got = ours(mx.array(x))
        mx.eval(got)
    assert_same(got, theirs(torch.tensor(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_relu_passes_the_gradient_through_a_nan_output_as_torch_does(backend):
    ours, theirs = module_pair("RNN_relu", 3, 4)
    x = nan_input("RNN_relu")
    with on_backend(backend):
        d_x = mx.grad(lambda inputs: ours(inputs)[0].sum())(mx.array(x))
    x_torch = torch.tensor(x, requires_grad=True)
    theirs(x_torch)[0].sum().backward()
    assert np.isfinite(x_torch.grad.numpy()).all()
    assert_same(d_x, x_torch.grad, rtol=1e-5, atol=1e-5)


def test_the_relu_and_tanh_kernels_keep_nan_and_signed_zero():
    values = mx.array([[np.nan, -0.0, -1.0, 2.0, np.inf, -np.inf]], mx.float32)
    with metal_backend():
        relu, tanh = kernels.rnn_activation(values, "relu"), kernels.rnn_activation(values, "tanh")
        d_relu = kernels.rnn_activation_backward(mx.ones_like(values), relu, "relu")
    reference = torch.tensor(np.array(values), requires_grad=True)
    torch.relu(reference).backward(torch.ones(1, 6))
    assert_same(relu, torch.relu(reference))
    assert np.signbit(np.array(relu)[0, 1])  # relu(-0.0) is -0.0 in torch
    assert_same(tanh, torch.tanh(reference))
    assert_same(d_relu, reference.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pointwise_functions_propagate_nan(backend):
    gates = mx.array(np.where(np.eye(2, 8, dtype=bool), np.nan, 0.5).astype(np.float32))
    with on_backend(backend):
        h, c, _, _ = pointwise.lstm_pointwise(gates, mx.zeros((2, 2)))
        h_gru, _ = pointwise.gru_pointwise(gates[:, :6], mx.zeros((2, 6)), mx.zeros((2, 2)))
    i, _, g, o = torch.tensor(np.array(gates)).chunk(4, 1)
    c_t = torch.sigmoid(i) * torch.tanh(g)
    assert_same((h, c), (torch.sigmoid(o) * torch.tanh(c_t), c_t), rtol=1e-5, atol=1e-6)
    assert np.isnan(np.array(h_gru)).tolist() == [[True, False], [False, True]]


# ================================================================= direct calls: batch sizes and shapes

BAD_BATCH_SIZES = {
    # name: (batch_sizes for 3 rows of a batch of 2, error type, words)
    "float list": ([2.0, 1.0], TypeError, ["batch_sizes", "float"]),
    "fractional floats": ([1.5, 1.5], TypeError, ["batch_sizes", "float"]),
    "NumPy floats": (np.array([2.0, 1.0]), TypeError, ["batch_sizes", "float"]),
    "MLX floats": ("mx_float", TypeError, ["batch_sizes", "float"]),
    "bools": ([True, True], TypeError, ["batch_sizes", "bool"]),
    "strings": (["2", "1"], TypeError, ["batch_sizes"]),
    "ragged": ([[2], [1, 0]], TypeError, ["batch_sizes"]),
    "a number": (3, TypeError, ["batch_sizes", "int"]),
    "2-D": ([[2, 1]], ValueError, ["batch_sizes", "1-D"]),
    "empty": ([], ValueError, ["batch_sizes", "non-empty"]),
    "increasing": ([1, 2], ValueError, ["batch_sizes", "non-increasing"]),
    "zero": ([3, 0], ValueError, ["batch_sizes", "at least 1"]),
    "negative": ([2, 2, -1], ValueError, ["batch_sizes", "at least 1"]),
    "first is not the batch": ([1, 1, 1], ValueError, ["batch_sizes", "batch size 2"]),
    "first past the batch": ([3], ValueError, ["batch_sizes", "batch size 2"]),
    "sum short": ([2], ValueError, ["batch_sizes", "x_gates has 3 rows"]),
    "sum long": ([2, 2], ValueError, ["batch_sizes", "x_gates has 3 rows"]),
    "sum far too long": ([2] * 40, ValueError, ["batch_sizes", "x_gates has 3 rows"]),
}
SEQUENCE_FUNCTIONS = ("kernels.lstm_sequence_forward", "kernels.gru_sequence_forward", "scan.lstm_sequence",
                      "scan.gru_sequence", "scan.rnn_sequence", "scan.lstm_input_sequence",
                      "scan.gru_input_sequence")  # fmt: skip


def sequence_arguments(function, rows=3, batch=2, hidden_size=4, dtype=mx.float32):
    """Well-formed arguments for ``function`` except batch_sizes, which the caller passes (in its order: the
    input-side sequences take x and w_ih where the others take x_gates)."""
    blocks = {"lstm": 4, "gru": 3, "rnn": 1}[function.split(".")[1].split("_")[0]]
    rng = np.random.default_rng(0)

    def draw(*shape):
        return mx.array(rng.normal(0, 0.5, shape).astype(np.float32)).astype(dtype)

    if "_input_" in function:
        arguments = {"x": draw(rows, 3), "w_ih": draw(blocks * hidden_size, 3)}
    else:
        arguments = {"x_gates": draw(rows, blocks * hidden_size)}
    arguments["w_hh"] = draw(blocks * hidden_size, hidden_size)
    if blocks == 3:
        arguments["b_hh"] = draw(blocks * hidden_size)
    arguments["h0"] = draw(batch, hidden_size)
    if blocks == 4:
        arguments["c0"] = draw(batch, hidden_size)
    return arguments


def call_sequence_function(function, backend, batch_sizes, reverse=False, **overrides):
    module, name = function.split(".")
    arguments = sequence_arguments(function) | {
        key: mx.array(value) if isinstance(value, np.ndarray) and value.dtype != object else value
        for key, value in overrides.items()
    }
    if isinstance(batch_sizes, str):
        batch_sizes = mx.array([2.0, 1.0])
    with on_backend(backend):
        result = getattr(kernels if module == "kernels" else scan, name)(
            *arguments.values(), batch_sizes, reverse
        )
        mx.eval(result)
        return result


@pytest.mark.parametrize("function", SEQUENCE_FUNCTIONS)
@pytest.mark.parametrize("case", list(BAD_BATCH_SIZES))
def test_bad_batch_sizes_for_a_direct_call_are_refused_not_truncated(case, function):
    batch_sizes, error, words = BAD_BATCH_SIZES[case]
    if "_input_" in function:  # its rows are x's
        words = [word.replace("x_gates", "x") for word in words]
    backend = "metal" if function.startswith("kernels") else "ops"
    outcome = run_isolated(call_sequence_function, function, backend, batch_sizes)
    assert_clear_error(outcome, *words, allowed=(error,), case=f"{case} -> {function}")


def function_backends(functions):
    """(function, backend) pairs: the kernels run on the Metal path only, the rest on both."""
    return [(function, backend) for function in functions for backend in BACKENDS
            if backend == "metal" or not function.startswith("kernels")]  # fmt: skip


@pytest.mark.parametrize(("function", "backend"), function_backends(SEQUENCE_FUNCTIONS))
def test_integer_batch_sizes_of_any_container_work(function, backend):
    results = [call_sequence_function(function, backend, sizes)
               for sizes in ([2, 1], (2, 1), np.array([2, 1], np.int32), mx.array([2, 1], mx.uint32))]  # fmt: skip
    for result in results[1:]:
        assert_same(result, results[0])


@st.composite
def drawn_batch_sizes(draw):
    """Mostly malformed batch sizes for 3 rows of 2 sequences; [2, 1] is the one well-formed answer."""
    return draw(st.just([2, 1]) | st.lists(st.integers(-1, 3), min_size=0, max_size=4))


@settings(max_examples=30)
@given(st.sampled_from(SEQUENCE_FUNCTIONS), drawn_batch_sizes(), st.booleans())
def test_drawn_batch_sizes_give_the_ops_paths_result_or_a_clear_error(function, batch_sizes, reverse):
    rows = 3
    outcome = run_isolated(call_sequence_function, function, "metal", batch_sizes, reverse)
    sizes = np.asarray(batch_sizes)
    valid = bool(sizes.size) and sizes.min() >= 1 and not np.any(np.diff(sizes) > 0)
    if not (valid and sizes[0] == 2 and sizes.sum() == rows):
        assert_clear_error(outcome, "batch_sizes", case=(function, batch_sizes))
        return
    ops_twin = "scan." + function.split(".")[1].removesuffix("_forward")
    reference = call_sequence_function(ops_twin, "ops", batch_sizes, reverse)
    assert outcome.kind == "returned", str(outcome)
    assert_same(outcome.value[: len(reference)], reference, rtol=1e-5, atol=1e-6)


def shape_cases():
    """(function, overrides, words): one malformed argument each, to direct calls of every recurrent function."""
    f16 = mx.float16
    return [
        ("kernels.lstm_sequence_forward", {"h0": mx.zeros((2, 5))}, ["x_gates", "(*, 20)"]),
        ("kernels.lstm_sequence_forward", {"c0": mx.zeros((2, 3))}, ["c0", "(2, 4)"]),
        ("kernels.lstm_sequence_forward", {"x_gates": mx.zeros((3, 15))}, ["x_gates", "(*, 16)"]),
        ("kernels.lstm_sequence_forward", {"w_hh": mx.zeros((16, 4), f16)}, ["w_hh", "float16"]),
        ("kernels.lstm_sequence_forward", {"h0": mx.zeros((2, 4), mx.float64)}, ["h0", "float64"]),
        ("kernels.lstm_sequence_forward", {"h0": np.zeros((2, 4), np.float32).tolist()}, ["h0", "list"]),
        ("kernels.lstm_sequence_forward", {"h0": mx.zeros((0, 4))}, ["h0", "non-empty"]),
        ("kernels.gru_sequence_forward", {"b_hh": mx.zeros((11,))}, ["b_hh", "(12,)"]),
        ("kernels.gru_sequence_forward", {"h0": mx.zeros((2, 1025)), "w_hh": mx.zeros((3075, 1025)),
                                  "x_gates": mx.zeros((3, 3075)), "b_hh": mx.zeros((3075,))}, ["h0", "1024"]),
        ("scan.lstm_sequence", {"c0": mx.zeros((2, 3))}, ["h0", "(2, 3)"]),
        ("scan.lstm_sequence", {"h0": mx.zeros((2, 4), f16)}, ["h0", "float16"]),
        ("scan.lstm_sequence", {"x_gates": mx.zeros((3, 16), mx.int32)}, ["x_gates", "floating"]),
        ("scan.lstm_sequence", {"c0": mx.zeros((2,))}, ["c0", "(*, *)"]),
        ("scan.gru_sequence", {"w_hh": mx.zeros((12, 3))}, ["w_hh", "(12, 4)"]),
        ("scan.gru_sequence", {"b_hh": None}, ["b_hh", "NoneType"]),
        ("scan.rnn_sequence", {"h0": mx.zeros((3, 4))}, ["batch_sizes", "batch size 3"]),
        ("scan.rnn_sequence", {"h0": mx.zeros((2, 0)), "w_hh": mx.zeros((0, 0)), "x_gates": mx.zeros((3, 0))},
         ["h0", "non-empty"]),
        ("scan.rnn_sequence", {"x_gates": mx.zeros((3, 4), mx.complex64)}, ["x_gates", "floating"]),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "backend"), [
    (case, backend) for case, (function, _, _) in enumerate(shape_cases())
    for backend in BACKENDS if backend == "metal" or not function.startswith("kernels")
])  # fmt: skip
def test_a_malformed_array_in_a_direct_call_is_a_clear_error(case, backend):
    function, overrides, words = shape_cases()[case]
    outcome = in_process(call_sequence_function, function, backend, [2, 1], **overrides)
    assert_clear_error(outcome, *words, case=(function, list(overrides)))


def test_the_lstm_projection_and_the_choices_are_checked():
    arguments = sequence_arguments("scan.lstm_sequence")
    h0 = mx.zeros((2, 3))
    w_hh = mx.zeros((16, 3))
    outcome = in_process(scan.lstm_sequence, arguments["x_gates"], w_hh, h0, arguments["c0"], [2, 1],
                         w_hr=mx.zeros((4, 4)))  # fmt: skip
    assert_clear_error(outcome, "w_hr", "(3, 4)")
    outcome = in_process(scan.rnn_sequence, mx.zeros((3, 4)), mx.zeros((4, 4)), mx.zeros((2, 4)), [2, 1],
                         nonlinearity="sigmoid")  # fmt: skip
    assert_clear_error(outcome, "nonlinearity", "sigmoid")
    with metal_backend():
        outcome = in_process(kernels.lstm_sequence_forward, *arguments.values(), [2, 1], version="fast")
        assert_clear_error(outcome, "version", "fast")
        assert_clear_error(in_process(kernels.rnn_activation, mx.zeros((2, 3)), "gelu"), "nonlinearity", "gelu")


CELL_KERNEL_CASES = [
    (kernels.lstm_pointwise, (mx.zeros((2, 7)), mx.zeros((2, 2))), ["gates", "(2, 8)"]),
    (kernels.lstm_pointwise, (mx.zeros((2, 8), mx.float16), mx.zeros((2, 2))), ["gates", "float16"]),
    (kernels.lstm_pointwise, (mx.zeros((2, 8)), mx.zeros((0, 2))), ["c_prev", "non-empty"]),
    (kernels.lstm_pointwise_backward, (mx.zeros((2, 2)), mx.zeros((2, 3)), mx.zeros((2, 8)), mx.zeros((2, 2)),
                                  mx.zeros((2, 2))), ["d_c", "(2, 2)"]),
    (kernels.gru_pointwise, (mx.zeros((2, 6)), mx.zeros((3, 6)), mx.zeros((2, 2))), ["hidden_side", "(2, 6)"]),
    (kernels.gru_pointwise_backward, (mx.zeros((2, 2)), mx.zeros((2, 6)), mx.zeros((2, 6)), mx.zeros((2,))),
     ["h_prev", "(*, *)", "(2,)"]),
    (kernels.rnn_activation, (mx.zeros((2, 3), mx.int32),), ["pre", "int32"]),
    (kernels.rnn_activation, (np.zeros((2, 3), np.float32),), ["pre", "ndarray"]),
    (kernels.rnn_activation_backward, (mx.zeros((2, 4)), mx.zeros((2, 3))), ["d_h", "(2, 3)"]),
    (pointwise.lstm_pointwise, (mx.zeros((2, 7)), mx.zeros((2, 2))), ["gates", "(2, 8)"]),
    (pointwise.lstm_pointwise, (mx.zeros((2, 8)), mx.zeros((2, 2), mx.float16)), ["gates", "float16"]),
    (pointwise.lstm_pointwise, ([[0.0] * 8], mx.zeros((1, 2))), ["gates", "list"]),
    (pointwise.gru_pointwise, (mx.zeros((2, 6)), mx.zeros((2, 5)), mx.zeros((2, 2))), ["hidden_side", "(2, 6)"]),
    (pointwise.gru_pointwise, (mx.zeros((2, 6)), mx.zeros((2, 6)), mx.zeros((2, 0))), ["h_prev", "non-empty"]),
    (pointwise.lstm_pointwise_backward, (mx.zeros((2, 2)), mx.zeros((2, 3)), mx.zeros((2, 8)), mx.zeros((2, 2)),
                                         mx.zeros((2, 2))), ["d_c", "(2, 2)"]),
    (pointwise.lstm_pointwise_backward, (mx.zeros((2, 2)), mx.zeros((2, 2)), mx.zeros((2, 8), mx.float16),
                                         mx.zeros((2, 2)), mx.zeros((2, 2))), ["activations", "float16"]),
    (pointwise.gru_pointwise_backward, (mx.zeros((2, 2)), mx.zeros((2, 5)), mx.zeros((2, 6)), mx.zeros((2, 2))),
     ["activations", "(2, 6)"]),
    (pointwise.gru_pointwise_backward, (None, mx.zeros((2, 6)), mx.zeros((2, 6)), mx.zeros((2, 2))),
     ["d_h", "NoneType"]),
    (kernels.sequence_kernel_serves, ("2", 4), ["batch", "str"]),
]  # fmt: skip


@pytest.mark.parametrize(("case", "backend"), [
    (case, backend) for case, (function, _, _) in enumerate(CELL_KERNEL_CASES)
    for backend in BACKENDS if backend == "metal" or not function.__module__.startswith("seqlib.kernels")
])  # fmt: skip
def test_a_malformed_argument_to_a_cell_kernel_or_pointwise_function_is_a_clear_error(case, backend):
    function, arguments, words = CELL_KERNEL_CASES[case]
    with on_backend(backend):
        assert_clear_error(in_process(function, *arguments), *words, case=function.__name__)


# ================================================================= empty inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ("RNN", "LSTM", "GRU"))
def test_a_batch_of_no_sequences_gives_empty_outputs_and_zero_gradients_as_in_torch(kind, batch_first, backend):
    options = {"batch_first": batch_first, "num_layers": 2, "bidirectional": True}
    if kind == "LSTM":
        options["proj_size"] = 2
    ours, theirs = module_pair(kind, 3, 4, **options)
    x = np.zeros((0, 5, 3) if batch_first else (5, 0, 3), np.float32)
    with on_backend(backend):
        got = ours(mx.array(x))
        _, grads = mlx.nn.value_and_grad(ours, lambda inputs: mx.sum(ours(inputs)[0]))(mx.array(x))
    expected = theirs(torch.tensor(x))
    assert_same(got, expected)
    expected[0].sum().backward()
    for name, parameter in theirs.named_parameters():
        assert_same(grads[name], parameter.grad)
    given_state = tuple(mx.zeros(state.shape) for state in expected[1]) if kind == "LSTM" else mx.zeros((4, 0, 4))
    assert_same(ours(mx.array(x), given_state)[1], expected[1])


@pytest.mark.parametrize("kind", LAYERS)
def test_zero_steps_and_zero_hidden_units_are_refused_as_in_torch(kind):
    assert_clear_error(in_process(layer_or_cell(kind), mx.zeros((0, 2, 3))), "input", "time step")
    assert_clear_error(in_process(layer_or_cell(kind), mx.zeros((0, 3))), "input", "time step")
    assert_clear_error(in_process(getattr(seqlib.nn, kind), 3, 0), "hidden_size")
    assert_clear_error(in_process(getattr(seqlib.nn, kind), 0, 3), "input_size")


CELL_SIZES = [(10, 0, 3), (0, 3, 2), (3, 4, 0), (0, 0, 0), (3, 0, None)]  # (input_size, hidden_size, batch or None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", CELL_SIZES)
@pytest.mark.parametrize("kind", ("RNNCell", "RNNCell_relu", "LSTMCell", "GRUCell"))
def test_cells_with_empty_sizes_match_torch_and_its_gradients(kind, sizes, backend):
    input_size, hidden_size, batch = sizes
    ours, theirs = module_pair(kind, input_size, hidden_size)
    x = np.random.default_rng(1).normal(size=(input_size,) if batch is None else (batch, input_size))
    x = x.astype(np.float32)
    with on_backend(backend):
        got = ours(mx.array(x))
        _, grads = mlx.nn.value_and_grad(ours, lambda inputs: sum(mx.sum(out) for out in _outputs(ours(inputs))))(
            mx.array(x)
        )
    expected = theirs(torch.tensor(x))
    assert_same(got, expected)
    sum(out.sum() for out in _outputs(expected)).backward()
    for name, parameter in theirs.named_parameters():
        assert_same(grads[name], parameter.grad if parameter.grad is not None else torch.zeros_like(parameter))


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def test_torchs_zero_hidden_size_cell_test():
    """test_nn.py's test_RNN_cell_forward_zero_hidden_size: (3, 10) input, (3, 0) state, (3, 0) out."""
    for cell in (seqlib.nn.RNNCell(10, 0, nonlinearity="relu"), seqlib.nn.RNNCell(10, 0), seqlib.nn.GRUCell(10, 0)):
        assert cell(mx.ones((3, 10)), mx.ones((3, 0))).shape == (3, 0)


EMPTY_PACKING = {
    "pack_padded_sequence with 0 sequences": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 0, 2)), []),
                                               ["input", "empty", "(4, 0, 2)"]),
    "pack_padded_sequence with 0 steps": (lambda: rnn.pack_padded_sequence(mx.zeros((0, 2, 2)), [1, 1]),
                                           ["input", "empty"]),
    "pack_padded_sequence (0, 0), torch's case": (lambda: rnn.pack_padded_sequence(mx.zeros((0, 0)), []),
                                                  ["input", "empty"]),
    "pack_padded_sequence (0, 1, 10), batch_first, torch's case": (
        lambda: rnn.pack_padded_sequence(mx.zeros((0, 1, 10)), mx.zeros((11, 14, 14, 2)), True), ["input", "empty"]),
    "pack_sequence of nothing": (lambda: rnn.pack_sequence([]), ["sequences", "non-empty"]),
    "pack_sequence with an empty sequence": (lambda: rnn.pack_sequence([mx.zeros((2, 3)), mx.zeros((0, 3))]),
                                             ["sequences[1]", "(0, 3)"]),
    "pad_sequence of nothing": (lambda: rnn.pad_sequence([]), ["sequences", "non-empty"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EMPTY_PACKING))
def test_empty_batches_cannot_be_packed_as_in_torch(case):
    call, words = EMPTY_PACKING[case]
    assert_clear_error(in_process(call), *words, case=case)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("lengths", [[0, 2], [0, 0], [3, 0, 1]])
def test_pad_sequence_pads_empty_sequences_as_torch(lengths, batch_first):
    sequences = [np.arange(length * 2, dtype=np.float32).reshape(length, 2) for length in lengths]
    ours = rnn.pad_sequence([mx.array(s) for s in sequences], batch_first, padding_value=-1.0)
    theirs = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in sequences], batch_first, padding_value=-1.0)
    assert_same(ours, theirs)


# ================================================================= everything else a careless user could pass


def packed_example():
    return rnn.pack_sequence([mx.ones((3, 3)), mx.ones((2, 3))])


BAD_CALLS = {
    # layers
    "layer input a NumPy array": (lambda: seqlib.nn.LSTM(3, 4)(np.zeros((5, 2, 3))),
                                  ["input", "ndarray", "PackedSequence"]),
    "layer input a list": (lambda: seqlib.nn.GRU(3, 4)([[0.0] * 3] * 5), ["input", "list"]),
    "layer input a plain tuple": (lambda: seqlib.nn.GRU(3, 4)((mx.zeros((3, 3)), mx.array([1]))), ["PackedSequence"]),
    "layer input 1-D": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((3,))), ["input", "(3,)"]),
    "layer input 4-D": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((1, 5, 2, 3))), ["input", "3-D"]),
    "layer input 0-D": (lambda: seqlib.nn.RNN(3, 4)(mx.array(1.0)), ["input", "()"]),
    "layer wrong feature size": (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5, 2, 2))), ["input", "input_size=3"]),
    "layer batch_first mismatch in h_0": (lambda: seqlib.nn.GRU(3, 4, batch_first=True)(mx.zeros((2, 5, 3)),
                                          mx.zeros((1, 5, 4))), ["hx", "(1, 2, 4)"]),
    "layer h_0 for the wrong batch": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((5, 2, 3)), mx.zeros((1, 3, 4))),
                                      ["hx", "(1, 2, 4)", "(1, 3, 4)"]),
    "layer h_0 missing the layer axis": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((5, 2, 3)), mx.zeros((2, 4))),
                                         ["hx", "(1, 2, 4)"]),
    "layer batched h_0 for unbatched input": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((5, 3)), mx.zeros((1, 1, 4))),
                                              ["hx", "(1, 4)"]),
    "layer h_0 a NumPy array": (lambda: seqlib.nn.RNN(3, 4)(mx.zeros((5, 2, 3)), np.zeros((1, 2, 4))),
                                ["hx", "ndarray"]),
    "GRU h_0 a tuple": (lambda: seqlib.nn.GRU(3, 4)(mx.zeros((5, 2, 3)), (mx.zeros((1, 2, 4)),)), ["hx", "tuple"]),
    "LSTM state of 3": (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5, 2, 3)), (mx.zeros((1, 2, 4)),) * 3),
                        ["hx", "tuple of 3"]),
    "LSTM state of 1": (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5, 2, 3)), [mx.zeros((1, 2, 4))]), ["hx", "list of 1"]),
    "LSTM state an array": (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5, 2, 3)), mx.zeros((1, 2, 4))), ["hx", "array"]),
    "LSTM c_0 a list": (lambda: seqlib.nn.LSTM(3, 4)(mx.zeros((5, 2, 3)), (mx.zeros((1, 2, 4)), [[0.0]])),
                        ["c_0", "list"]),
    "projected LSTM h_0 of hidden_size": (lambda: seqlib.nn.LSTM(3, 4, proj_size=2)(
        mx.zeros((5, 2, 3)), (mx.zeros((1, 2, 4)), mx.zeros((1, 2, 4)))), ["h_0", "(1, 2, 2)"]),
    "projected LSTM c_0 of proj_size": (lambda: seqlib.nn.LSTM(3, 4, proj_size=2)(
        mx.zeros((5, 2, 3)), (mx.zeros((1, 2, 2)), mx.zeros((1, 2, 2)))), ["c_0", "(1, 2, 4)"]),
    "packed h_0 for the wrong batch": (lambda: seqlib.nn.GRU(3, 4)(packed_example(), mx.zeros((1, 3, 4))),
                                       ["hx", "(1, 2, 4)"]),
    "packed data 3-D": (lambda: seqlib.nn.GRU(3, 4)(PackedSequence(mx.zeros((5, 1, 3)), mx.array([2, 2, 1]))),
                        ["input.data", "(N, input_size=3)"]),
    "packed data wrong features": (lambda: seqlib.nn.LSTM(2, 4)(packed_example()), ["input.data", "input_size=2"]),
    "proj_size = hidden_size": (lambda: seqlib.nn.LSTM(3, 4, proj_size=4), ["proj_size", "hidden_size=4"]),
    "proj_size negative": (lambda: seqlib.nn.LSTM(3, 4, proj_size=-1), ["proj_size"]),
    "proj_size a float": (lambda: seqlib.nn.LSTM(3, 4, proj_size=2.0), ["proj_size"]),
    "nonlinearity": (lambda: seqlib.nn.RNN(3, 4, nonlinearity="sigmoid"), ["nonlinearity", "sigmoid"]),
    "num_layers 0": (lambda: seqlib.nn.GRU(3, 4, num_layers=0), ["num_layers"]),
    "hidden_size a float": (lambda: seqlib.nn.GRU(3, 4.0), ["hidden_size"]),
    "dropout above 1": (lambda: seqlib.nn.LSTM(3, 4, dropout=1.5), ["dropout"]),
    # cells (test_nn.py's test_RNN_cell_no_broadcasting among them)
    "cell input 3-D": (lambda: seqlib.nn.GRUCell(3, 4)(mx.zeros((1, 2, 3))), ["input", "(1, 2, 3)"]),
    "cell input 0-D": (lambda: seqlib.nn.GRUCell(3, 4)(mx.array(1.0)), ["input", "()"]),
    "cell input of 1 feature": (lambda: seqlib.nn.RNNCell(10, 20)(mx.zeros((3, 1)), mx.zeros((3, 20))),
                                ["input", "(3, 1)"]),
    "cell hx of another batch": (lambda: seqlib.nn.RNNCell(10, 20)(mx.zeros((3, 10)), mx.zeros((1, 20))),
                                 ["hx", "(3, 20)", "(1, 20)"]),
    "cell hx of 1 unit": (lambda: seqlib.nn.GRUCell(10, 20)(mx.zeros((3, 10)), mx.zeros((3, 1))), ["hx", "(3, 20)"]),
    "LSTMCell c of another batch": (lambda: seqlib.nn.LSTMCell(10, 20)(mx.zeros((3, 10)),
                                    (mx.zeros((3, 20)), mx.zeros((1, 20)))), ["hx[1]", "(3, 20)"]),
    "LSTMCell state of 3": (lambda: seqlib.nn.LSTMCell(3, 4)(mx.zeros((2, 3)), (mx.zeros((2, 4)),) * 3),
                            ["hx", "tuple of 3"]),
    "LSTMCell state an array": (lambda: seqlib.nn.LSTMCell(3, 4)(mx.zeros((2, 3)), mx.zeros((2, 4))), ["hx", "array"]),
    "cell input a list": (lambda: seqlib.nn.LSTMCell(3, 4)([[0.0] * 3]), ["input", "list"]),
    "cell hx a NumPy array": (lambda: seqlib.nn.RNNCell(3, 4)(mx.zeros((2, 3)), np.zeros((2, 4))), ["hx", "ndarray"]),
    "cell negative size": (lambda: seqlib.nn.GRUCell(3, -1), ["hidden_size", "-1"]),
    "cell size a float": (lambda: seqlib.nn.GRUCell(3.0, 4), ["input_size", "float"]),
    "cell nonlinearity": (lambda: seqlib.nn.RNNCell(3, 4, nonlinearity="gelu"), ["nonlinearity", "gelu"]),
    # packing
    "pack input a NumPy array": (lambda: rnn.pack_padded_sequence(np.zeros((4, 2, 1)), [4, 2]), ["input", "ndarray"]),
    "pack input 1-D": (lambda: rnn.pack_padded_sequence(mx.zeros((4,)), [4]), ["input", "2 dimensions"]),
    "lengths as floats": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [4.0, 2.0]), ["lengths", "float"]),
    "lengths as a float array": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), mx.array([4.0, 2.0])),
                                 ["lengths", "float"]),
    "lengths as bools": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [True, True]), ["lengths", "bool"]),
    "lengths ragged": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [[4], [2, 1]]), ["lengths"]),
    "lengths a number": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 1, 1)), 4), ["lengths", "int"]),
    "lengths 2-D": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [[4, 2]]), ["lengths", "1-D"]),
    "lengths negative": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [4, -1]), ["lengths", "[1, 4]"]),
    "lengths zero": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [4, 0]), ["lengths", "[1, 4]"]),
    "lengths too long": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [5, 2]), ["lengths", "[1, 4]", "5"]),
    "lengths too few": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 3, 1)), [4, 2]), ["lengths", "(3)", "2"]),
    "lengths too many": (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 1)), [4, 2, 1]), ["lengths", "(2)", "3"]),
    "lengths for batch_first read as time-major": (
        lambda: rnn.pack_padded_sequence(mx.zeros((2, 4, 1)), [4, 2]), ["lengths", "(4)"]),
    "lengths unsorted with enforce_sorted (torch's test_wrong_order)": (
        lambda: rnn.pack_padded_sequence(mx.zeros((25, 2, 3)), [22, 25]), ["lengths", "enforce_sorted=False"]),
    "lengths unsorted, torch's (3, 3) case": (lambda: rnn.pack_padded_sequence(mx.zeros((3, 3)), [1, 3, 2]),
                                              ["enforce_sorted=False"]),
    "total_length shorter": (lambda: rnn.pad_packed_sequence(packed_example(), total_length=2),
                             ["total_length", "3", "2"]),
    "total_length 0 (torch's test_total_length)": (lambda: rnn.pad_packed_sequence(packed_example(), total_length=0),
                                                    ["total_length"]),
    "total_length -1 (torch's test_total_length)": (lambda: rnn.pad_packed_sequence(packed_example(), total_length=-1),
                                                     ["total_length"]),
    "total_length a float": (lambda: rnn.pad_packed_sequence(packed_example(), total_length=5.0),
                             ["total_length", "float"]),
    "padding_value a string": (lambda: rnn.pad_packed_sequence(packed_example(), padding_value="0"),
                               ["padding_value", "str"]),
    "pad_sequence padding_side": (lambda: rnn.pad_sequence([mx.zeros((3, 1))], padding_side="middle"),
                                  ["padding_side", "middle"]),
    "pad_sequence trailing shapes differ": (lambda: rnn.pad_sequence([mx.zeros((3, 1)), mx.zeros((2, 2))]),
                                            ["sequences", "trailing shape"]),
    "pad_sequence a scalar sequence": (lambda: rnn.pad_sequence([mx.zeros((3,)), mx.array(1.0)]),
                                       ["sequences[1]", "scalar"]),
    "pad_sequence of NumPy arrays": (lambda: rnn.pad_sequence([np.zeros((3, 1))]), ["sequences[0]", "ndarray"]),
    "pad_sequence of a number (torch's non-iterable test)": (lambda: rnn.pad_sequence(5), ["sequences", "int"]),
    "pad_sequence of a 1-D array": (lambda: rnn.pad_sequence(mx.zeros((3,))), ["sequences", "2 dimensions"]),
    "pack_sequence unsorted": (lambda: rnn.pack_sequence([mx.zeros((1, 3)), mx.zeros((2, 3))]),
                               ["enforce_sorted=False"]),
    "pack_sequence of a number": (lambda: rnn.pack_sequence(3), ["sequences", "int"]),
    "unpack_sequence of an array": (lambda: rnn.unpack_sequence(mx.zeros((3, 2))), ["packed_sequences", "array"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_malformed_arguments_raise_a_clear_error(case):
    call, words = BAD_CALLS[case]
    assert_clear_error(in_process(call), *words, case=case)


def test_pad_sequence_takes_an_array_or_any_iterable_as_torch():
    """torch's test_pad_sequence_with_tensor_sequences, and a generator; the first sequence's dtype wins (torch's)."""
    from_tuple = rnn.pad_sequence((mx.array([[7, 6]]), mx.array([[-7, -1]])))
    from_array = rnn.pad_sequence(mx.array([[[7, 6]], [[-7, -1]]]))
    assert from_tuple.shape == (1, 2, 2)
    assert_same(from_array, from_tuple)
    generated = rnn.pad_sequence(s for s in [mx.ones((2, 3)), mx.ones((1, 3))])
    assert generated.shape == (2, 2, 3)
    mixed = rnn.pad_sequence([mx.ones((2, 3)), mx.ones((1, 3), mx.float16)])
    theirs = torch.nn.utils.rnn.pad_sequence([torch.ones(2, 3), torch.ones(1, 3, dtype=torch.float16)])
    assert mixed.dtype == mx.float32 and theirs.dtype == torch.float32
    assert_same(mixed, theirs)


@pytest.mark.parametrize("batch_first", [False, True])
def test_total_length_pads_with_extra_steps_as_torch(batch_first):
    """torch's test_total_length: total_length = max, max + 1, max + 8."""
    lengths = [4, 3, 1]
    sequences = [np.random.default_rng(length).normal(size=(length, 2)).astype(np.float32) for length in lengths]
    ours = rnn.pack_sequence([mx.array(s) for s in sequences])
    theirs = torch.nn.utils.rnn.pack_sequence([torch.tensor(s) for s in sequences])
    for extra in (0, 1, 8):
        got = rnn.pad_packed_sequence(ours, batch_first, total_length=4 + extra)
        expected = torch.nn.utils.rnn.pad_packed_sequence(theirs, batch_first, total_length=4 + extra)
        assert_same(got, expected)


@st.composite
def drawn_lengths(draw):
    """Lengths for a (T, B) batch: well-formed ones, floats, or ints that may be out of range or miscounted."""
    steps, batch = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["well-formed", "well-formed", "ints", "floats", "wrong count"]))
    if kind == "well-formed":
        lengths = draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch))
    elif kind == "floats":
        lengths = [float(draw(st.integers(1, steps))) for _ in range(batch)]
    else:
        count = batch if kind == "ints" else draw(st.sampled_from([batch - 1, batch + 1]))
        lengths = draw(st.lists(st.integers(-1, steps + 1), min_size=count, max_size=count))
    enforce_sorted = draw(st.booleans())
    if enforce_sorted and kind == "well-formed" and draw(st.booleans()):
        lengths.sort(reverse=True)
    container = draw(st.sampled_from(["list", "numpy", "mlx", "torch"]))
    return steps, batch, lengths, container, draw(st.booleans()), enforce_sorted


def lengths_in(container, lengths):
    if container == "numpy":
        return np.array(lengths)
    if container == "mlx":
        return mx.array(lengths) if lengths else mx.array(np.zeros(0, np.int64))
    if container == "torch":
        return torch.tensor(lengths)
    return list(lengths)


@settings(max_examples=40)
@given(drawn_lengths())
def test_drawn_lengths_pack_as_torch_or_raise_a_clear_error(case):
    steps, batch, lengths, container, batch_first, enforce_sorted = case
    shape = (batch, steps, 2) if batch_first else (steps, batch, 2)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    outcome = in_process(rnn.pack_padded_sequence, mx.array(x), lengths_in(container, lengths), batch_first,
                         enforce_sorted)  # fmt: skip
    valid = (
        len(lengths) == batch
        and all(isinstance(length, int) and 1 <= length <= steps for length in lengths)
        and not (enforce_sorted and np.any(np.diff(lengths) > 0))
    )
    if not valid:
        assert_clear_error(outcome, "lengths", case=case)
        return
    assert outcome.kind == "returned", str(outcome)
    theirs = torch.nn.utils.rnn.pack_padded_sequence(
        torch.tensor(x), torch.tensor(lengths), batch_first, enforce_sorted
    )
    for mine, their in zip(outcome.value, theirs, strict=True):
        assert (mine is None) == (their is None)
        if their is not None:
            assert_same(mine, their)
    assert_same(rnn.pad_packed_sequence(outcome.value, batch_first)[1], torch.tensor(lengths))


def right_state_shape(kind, shape, batch_first):
    """The state shape torch expects for an input of ``shape`` (assumed well-formed)."""
    if kind in CELLS:
        return [*shape[:-1], 4]
    if len(shape) != 3:
        return [1, 4]
    return [1, shape[0] if batch_first else shape[1], 4]


@st.composite
def drawn_layer_calls(draw):
    """Calls of a (3 -> 4) layer or cell: mostly well-formed, sometimes one thing off (rank, a size, dtype, state)."""
    kind = draw(st.sampled_from(LAYERS + CELLS))
    cell = kind in CELLS
    rank = draw(st.sampled_from([1, 2, 2, 2, 0, 3] if cell else [2, 3, 3, 3, 1, 4]))
    shape = [draw(st.sampled_from([1, 2, 3, 1, 2, 0])) for _ in range(rank)]
    if shape and draw(st.integers(0, 4)):
        shape[-1] = 3  # the right feature size, more often than not
    dtype = draw(st.sampled_from(["float32"] * 8 + ["float16", "int32"]))
    batch_first = draw(st.booleans())
    state = draw(st.sampled_from(["none", "right", "right", "drawn"]))
    if state == "right":
        state = right_state_shape(kind, shape, batch_first) if shape else None
    elif state == "drawn":
        state = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    else:
        state = None
    return kind, cell, tuple(shape), dtype, state, batch_first


@settings(max_examples=60)
@given(drawn_layer_calls())
def test_drawn_layer_and_cell_calls_match_torch_or_raise_a_clear_error(case):
    kind, cell, shape, dtype, state_shape, batch_first = case
    options = {} if cell else {"batch_first": batch_first}
    ours, theirs = module_pair(kind, 3, 4, **options)
    x = np.random.default_rng(0).normal(size=shape).astype(dtype)
    states = None
    if state_shape is not None:
        states = np.random.default_rng(1).normal(size=state_shape).astype(np.float32)
        states = (states, states) if kind.startswith("LSTM") else states
    to_mx = lambda value: None if value is None else (tuple(map(mx.array, value)) if isinstance(value, tuple)
                                                      else mx.array(value))  # fmt: skip
    to_torch = lambda value: None if value is None else (tuple(map(torch.tensor, value)) if isinstance(value, tuple)
                                                         else torch.tensor(value))  # fmt: skip
    outcome = in_process(ours, mx.array(x), to_mx(states))
    try:
        expected = theirs(torch.tensor(x), to_torch(states))
    except Exception as error:  # torch refuses: so must seqlib
        assert_clear_error(outcome, case=(case, str(error)[:80]))
        return
    assert outcome.kind == "returned", f"{case}: torch gave a result, seqlib {outcome}"
    assert_same(outcome.value, expected, rtol=1e-5, atol=1e-6)


def lengths_of(batch_sizes, sorted_indices, unsorted_indices):
    as_array = lambda values: None if values is None else mx.array(values)
    packed = PackedSequence(mx.zeros((sum(batch_sizes), 2)), mx.array(batch_sizes), as_array(sorted_indices),
                            as_array(unsorted_indices))
    return packed.lengths()


@pytest.mark.parametrize(
    ("batch_sizes", "sorted_indices", "unsorted_indices", "named"),
    [
        ([2, 3], None, None, "batch_sizes"),
        ([2, 0], None, None, "batch_sizes"),
        ([2, 1], [0, 1], [0, 5], "unsorted_indices"),
        ([2, 1], None, [-1, 0], "unsorted_indices"),
    ],
)
def test_lengths_of_a_malformed_sequence_is_a_clear_error(batch_sizes, sorted_indices, unsorted_indices, named):
    assert_clear_error(run_isolated(lengths_of, batch_sizes, sorted_indices, unsorted_indices), named)


def test_lengths_in_the_callers_order():
    np.testing.assert_array_equal(lengths_of([3, 2, 1], [2, 0, 1], [1, 2, 0]), [2, 1, 3])
