"""Quantized tables: mlx.nn.quantize converts seqlib's Embedding and EmbeddingBag, and they give exactly the
float table's answer on the dequantized table, with the same index checks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import seqlib


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
