"""Quantized tables: mlx.nn.quantize converts seqlib's Embedding and EmbeddingBag, and they give exactly the
float table's answer on the dequantized table, with the same index checks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import seqlib
from seqlib import native


@pytest.mark.parametrize("bits", [4, 8])
def test_nn_quantize_converts_tables_and_they_read_the_dequantized_table(bits):
    mx.random.seed(0)
    model = nn.Sequential(seqlib.nn.Embedding(50, 64, padding_idx=3))
    bags = seqlib.nn.EmbeddingBag(50, 64, mode="mean", padding_idx=3)
    holder = nn.Module()
    holder.table, holder.bags = model, bags
    nn.quantize(holder, group_size=32, bits=bits)
    table, bags = holder.table.layers[0], holder.bags
    assert isinstance(table, seqlib.nn.QuantizedEmbedding) and isinstance(bags, seqlib.nn.QuantizedEmbeddingBag)
    assert table.bits == bits and bags.mode == "mean" and not table.trainable_parameters()

    ids = mx.array([[1, 3, 7, 7], [49, 0, 3, 2]])
    np.testing.assert_array_equal(np.array(table(ids)), np.array(table.dequantized()[ids]))
    float_bags = seqlib.nn.EmbeddingBag.from_pretrained(bags.dequantized(), mode="mean", padding_idx=3)
    np.testing.assert_allclose(np.array(bags(ids)), np.array(float_bags(ids)), atol=1e-6)
    offsets = mx.array([0, 3, 3])
    flat = ids.reshape(-1)
    np.testing.assert_allclose(np.array(bags(flat, offsets)), np.array(float_bags(flat, offsets)), atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantization_error_is_within_the_grid(bits):
    table = seqlib.nn.Embedding(200, 128)
    quantized = table.to_quantized(group_size=64, bits=bits)
    error = float(mx.abs(quantized.dequantized() - table.weight).max())
    spread = float(table.weight.max() - table.weight.min())
    assert 0 < error <= spread / (2**bits - 1)  # at most one step of the coarsest group's grid


def test_quantized_tables_check_their_indices_and_arguments():
    table = seqlib.nn.Embedding(10, 32).to_quantized(group_size=32)
    with pytest.raises(IndexError, match=r"input: every index must lie in \[0, 10\)"):
        table(mx.array([0, 10]))
    with pytest.raises(ValueError, match="max_norm"):
        seqlib.nn.Embedding(10, 32, max_norm=1.0).to_quantized(group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        seqlib.nn.Embedding(10, 48).to_quantized(group_size=32)
    bags = seqlib.nn.EmbeddingBag(10, 32, mode="sum").to_quantized(group_size=32)
    with pytest.raises(ValueError, match="offsets"):
        bags(mx.array([1, 2]), mx.array([1]))


def test_a_quantized_model_compiles_and_exports(tmp_path):
    model = nn.Sequential(seqlib.nn.Embedding(30, 32), nn.Linear(32, 4))
    nn.quantize(model, group_size=32, bits=4)
    ids = mx.array([[1, 2, 3]])
    want = model(ids)
    np.testing.assert_array_equal(np.array(mx.compile(model)(ids)), np.array(want))
    path = str(tmp_path / "quantized.mlxfn")
    seqlib.export_function(path, model, ids)
    np.testing.assert_array_equal(np.array(mx.import_function(path)(ids)[0]), np.array(want))


RECURRENT = {
    "LSTM": lambda: seqlib.nn.LSTM(64, 64, num_layers=2, bidirectional=True),
    "LSTM-proj": lambda: seqlib.nn.LSTM(64, 128, proj_size=64),
    "GRU": lambda: seqlib.nn.GRU(64, 64, batch_first=True),
    "RNN": lambda: seqlib.nn.RNN(128, 64, nonlinearity="relu", bias=False),
    "LSTMCell": lambda: seqlib.nn.LSTMCell(64, 64),
    "GRUCell": lambda: seqlib.nn.GRUCell(64, 64),
}


def _recurrent_input(name):
    size = 128 if name == "RNN" else 64
    shape = (5, size) if name.endswith("Cell") else (3, 5, size)
    return mx.random.normal(shape, key=mx.random.key(1))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", RECURRENT)
def test_a_quantized_recurrent_module_computes_the_float_one_on_its_dequantized_weights(name, bits):
    mx.random.seed(3)
    module = RECURRENT[name]()
    quantized = module.to_quantized(group_size=32, bits=bits)
    assert not quantized.trainable_parameters()
    assert all(quantized[name].dtype == mx.uint32 for name in quantized.matrix_names)
    x = _recurrent_input(name)
    reference = RECURRENT[name]()
    reference.update(quantized.dequantized())
    got, want = quantized(x), reference(x)
    for mine, theirs in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                            strict=True):  # fmt: skip
        mine, theirs = (mine, theirs) if isinstance(mine, mx.array) else (mine[0], theirs[0])
        if name.endswith("Cell") and native.available():  # one step: the packed integers, summed in another order
            np.testing.assert_allclose(np.array(mine), np.array(theirs), rtol=1e-5, atol=2e-6)
        else:
            np.testing.assert_array_equal(np.array(mine), np.array(theirs))
    float_output = module(x)
    float_output = float_output[0] if isinstance(float_output, tuple) else float_output
    got = got[0] if isinstance(got, tuple) else got
    assert float(mx.abs(got - float_output).max()) < (0.05 if bits == 8 else 0.5)  # a quantization error, bounded


def test_nn_quantize_converts_a_whole_model_and_it_compiles_and_exports(tmp_path):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = seqlib.nn.Embedding(50, 64)
            self.rnn = seqlib.nn.GRU(64, 64, batch_first=True)
            self.head = nn.Linear(64, 50)

        def __call__(self, ids):
            return self.head(self.rnn(self.embedding(ids))[0])

    model = Model()
    nn.quantize(model, group_size=64, bits=8)
    assert isinstance(model.rnn, seqlib.nn.QuantizedRecurrent) and isinstance(model.head, nn.QuantizedLinear)
    ids = mx.array([[1, 2, 3, 4]])
    want = model(ids)
    np.testing.assert_allclose(np.array(mx.compile(model)(ids)), np.array(want), atol=1e-6)
    path = str(tmp_path / "model.mlxfn")
    seqlib.export_function(path, model, ids)
    np.testing.assert_allclose(np.array(mx.import_function(path)(ids)[0]), np.array(want), atol=2e-5)


def test_a_recurrent_module_whose_columns_do_not_fit_the_groups_is_refused():
    with pytest.raises(ValueError, match="group_size: weight_ih_l0 has 10 columns"):
        seqlib.nn.LSTM(10, 64).to_quantized(group_size=64)


STREAMED = {
    "LSTMCell": lambda bias: seqlib.nn.LSTMCell(64, 128, bias=bias),
    "GRUCell": lambda bias: seqlib.nn.GRUCell(128, 64, bias=bias),
    "RNNCell relu": lambda bias: seqlib.nn.RNNCell(64, 64, bias=bias, nonlinearity="relu"),
    "LSTM 2 layers": lambda bias: seqlib.nn.LSTM(64, 128, num_layers=2, bias=bias),
    "GRU": lambda bias: seqlib.nn.GRU(128, 64, bias=bias),
    "RNN 2 layers": lambda bias: seqlib.nn.RNN(64, 64, num_layers=2, bias=bias),
    # over 1 MB of float weights: a team of threads shares the products' rows (on a machine with 2 cores or more)
    "LSTMCell wide": lambda bias: seqlib.nn.LSTMCell(640, 640, bias=bias),
    "GRUCell wide": lambda bias: seqlib.nn.GRUCell(320, 576, bias=bias),
}


def _stream(module, xs, is_cell):
    """Run module one step at a time over xs (T, B, D), state carried: every output, stacked."""
    state, outputs = None, []
    for x in xs:
        if is_cell:
            state = module(x, state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
        else:
            output, state = module.step(x, state)
            outputs.append(output)
    return mx.stack(outputs)


@pytest.mark.skipif(not native.available(), reason="the quantized step is seqlib.native's")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", STREAMED)
def test_a_streamed_quantized_step_reads_the_packed_weights_and_computes_the_dequantized_module(name, bias, bits,
                                                                                               monkeypatch):
    """A single step on the C++ primitives reads the packed integers (seqlib.native's quantized_step) and gives
    the float module's step on the dequantized weights, within float32 rounding, over a stream of steps."""
    mx.random.seed(5)
    module = STREAMED[name](bias)
    quantized = module.to_quantized(group_size=64, bits=bits)
    reference = STREAMED[name](bias)
    reference.update(quantized.dequantized())
    is_cell = name.split()[0].endswith("Cell")
    calls = []
    recurrence = next(base for base in type(module).__mro__ if "_native_quantized_step" in base.__dict__)
    original = recurrence._native_quantized_step
    monkeypatch.setattr(recurrence, "_native_quantized_step", lambda *a: calls.append(1) or original(*a))
    xs = mx.random.normal((6, 2, module.input_size), key=mx.random.key(2))
    got, want = _stream(quantized, xs, is_cell), _stream(reference, xs, is_cell)
    assert len(calls) == len(xs)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("bits", [2, 6])
def test_quantizations_the_step_cannot_read_run_on_the_dequantized_weights(bits):
    mx.random.seed(6)
    module = seqlib.nn.LSTMCell(64, 64)
    quantized = module.to_quantized(group_size=32, bits=bits)
    assert quantized.native_step_weights([""]) is None
    reference = seqlib.nn.LSTMCell(64, 64)
    reference.update(quantized.dequantized())
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    for mine, theirs in zip(quantized(x), reference(x), strict=True):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))


@pytest.mark.skipif(not native.available(), reason="the quantized step is seqlib.native's")
def test_the_quantized_step_refuses_malformed_arrays_with_a_clear_error():
    module = seqlib.nn.LSTMCell(64, 64).to_quantized(group_size=64, bits=8)
    weights = module.native_step_weights([""])
    x, h = mx.zeros((1, 64)), mx.zeros((1, 64))
    step = native.extension().quantized_step
    with pytest.raises(ValueError, match="w_ih: expected packed values uint32 of shape"):
        step("lstm", x, [h, h], [weights[0][:, :4], *weights[1:]], 64, 8)
    with pytest.raises(ValueError, match="bits: expected 4 or 8, got 3"):
        step("lstm", x, [h, h], weights, 64, 3)
    with pytest.raises(ValueError, match="group_size: expected a multiple of 16"):
        step("lstm", x, [h, h], weights, 24, 8)
    with pytest.raises(ValueError, match="kind: expected"):
        step("elman", x, [h], weights, 64, 8)
    with pytest.raises(ValueError, match="expected 8 weights for each layer"):
        step("lstm", x, [h, h], weights[:6], 64, 8)
    with pytest.raises(ValueError, match="b_hh: expected float32 of shape"):
        step("lstm", x, [h, h], [*weights[:7], mx.zeros((3,))], 64, 8)
    with pytest.raises(ValueError, match="x and the states differ in batch size"):
        step("lstm", mx.zeros((2, 64)), [h, h], weights, 64, 8)


@pytest.mark.skipif(not native.available(), reason="the quantized step is seqlib.native's")
def test_a_streamed_step_reads_the_arrays_that_replaced_the_stored_ones():
    """native_step_weights keeps its arrays until a stored array is replaced (``update``, ``load_weights``):
    the next step reads the new packed weights."""
    mx.random.seed(8)
    module = seqlib.nn.LSTMCell(64, 64).to_quantized(group_size=64, bits=8)
    other = seqlib.nn.LSTMCell(64, 64).to_quantized(group_size=64, bits=8)
    x = mx.random.normal((1, 64), key=mx.random.key(3))
    before = module(x)
    first = module.native_step_weights([""])
    assert module.native_step_weights([""]) is first  # kept while nothing changed
    module.update(other.parameters())
    assert module.native_step_weights([""])[0] is other["weight_ih"]
    for mine, theirs in zip(module(x), other(x), strict=True):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))
    assert not np.array_equal(np.array(module(x)[0]), np.array(before[0]))


def _packed(levels: np.ndarray, bits: int) -> np.ndarray:
    """(N, K) integers below 2**bits packed as mx.quantize packs them: value k of a row in bits
    [bits (k mod 32 / bits), + bits) of uint32 word k / (32 / bits)."""
    per_word = 32 // bits
    shifts = (bits * np.arange(per_word, dtype=np.uint32))[None, None, :]
    words = levels.astype(np.uint32).reshape(levels.shape[0], -1, per_word) << shifts
    return np.bitwise_or.reduce(words, axis=2).astype(np.uint32)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_packing_helper_packs_as_mx_quantize_does(bits):
    weight = mx.random.normal((8, 64), key=mx.random.key(3))
    packed, scales, biases = mx.quantize(weight, 32, bits)
    dequantized = np.array(mx.dequantize(packed, scales, biases, group_size=32, bits=bits))
    spread = np.repeat(np.array(scales), 32, axis=1), np.repeat(np.array(biases), 32, axis=1)
    levels = np.rint((dequantized - spread[1]) / spread[0]).astype(np.int64)
    assert levels.min() >= 0 and levels.max() < 2**bits
    np.testing.assert_array_equal(_packed(levels, bits), np.array(packed))


@pytest.mark.skipif(not native.available(), reason="the quantized step is seqlib.native's")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 48])
def test_the_quantized_step_reads_groups_of_an_odd_number_of_vectors(group_size, bits):
    """Groups of 16 or 48 columns (mx.quantize makes 32, 64 and 128; the step takes any multiple of 16) are an
    odd number of vectors where they hold 16 floats: the step sums the last one on its own."""
    rng = np.random.default_rng(group_size + bits)
    input_size, hidden = 96, 48
    reference = seqlib.nn.LSTMCell(input_size, hidden)
    weights = []
    for name, columns in (("weight_ih", input_size), ("weight_hh", hidden)):
        levels = rng.integers(0, 2**bits, size=(4 * hidden, columns))
        scales = rng.uniform(0.001, 0.01, size=(4 * hidden, columns // group_size)).astype(np.float32)
        biases = rng.uniform(-0.1, 0.1, size=scales.shape).astype(np.float32)
        spread = np.repeat(scales, group_size, axis=1), np.repeat(biases, group_size, axis=1)
        reference[name] = mx.array(spread[0] * levels.astype(np.float32) + spread[1])
        weights += [mx.array(_packed(levels, bits)), mx.array(scales), mx.array(biases)]
    weights += [reference.bias_ih, reference.bias_hh]
    x = mx.array(rng.standard_normal((3, input_size)).astype(np.float32))
    h, c = (mx.array(rng.standard_normal((3, hidden)).astype(np.float32)) for _ in range(2))
    got = native.extension().quantized_step("lstm", x, [h, c], weights, group_size, bits)
    want = reference(x, (h, c))
    for mine, theirs in zip(got[1:], want, strict=True):
        np.testing.assert_allclose(np.array(mine), np.array(theirs), rtol=1e-5, atol=2e-6)
