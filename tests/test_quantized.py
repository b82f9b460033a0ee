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
