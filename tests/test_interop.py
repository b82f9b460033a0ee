"""Weights between torch and seqlib: from_torch, load_torch_state_dict, torch_state_dict."""

import io

import mlx.core as mx
import numpy as np
import pytest
import torch
from torch_reference import assert_close

import seqlib

TORCH_TABLES = [
    lambda: torch.nn.Embedding(7, 3),
    lambda: torch.nn.Embedding(7, 3, padding_idx=2, max_norm=1.5, norm_type=1.0, scale_grad_by_freq=True),
    lambda: torch.nn.Embedding(7, 3, sparse=True, dtype=torch.float16),
    lambda: torch.nn.EmbeddingBag(7, 3),
    lambda: torch.nn.EmbeddingBag(7, 3, mode="max", padding_idx=-1, include_last_offset=True),
    lambda: torch.nn.EmbeddingBag(7, 3, mode="sum", sparse=True, max_norm=2.0, dtype=torch.bfloat16),
]
OPTIONS = ["num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
           "sparse", "mode", "include_last_offset"]  # fmt: skip


@pytest.mark.parametrize("make", TORCH_TABLES)
def test_from_torch_copies_options_and_weights(make):
    torch.manual_seed(0)
    theirs = make()
    ours = seqlib.from_torch(theirs)
    assert type(ours).__name__ == type(theirs).__name__
    for option in OPTIONS:
        if hasattr(theirs, option):
            assert getattr(ours, option) == getattr(theirs, option), option
    assert str(ours.weight.dtype).split(".")[-1] == str(theirs.weight.dtype).split(".")[-1]
    assert_close(ours.weight, theirs.weight.float(), rtol=0, atol=0)
    ids = torch.tensor([[0, 2, 6], [1, 1, 3]])
    expected = theirs(ids).float()
    assert_close(ours(mx.array(ids.numpy())), expected, rtol=1e-2, atol=1e-2)


def test_frozen_torch_weight_gives_a_frozen_table():
    frozen = torch.nn.Embedding.from_pretrained(torch.ones(3, 2))
    assert seqlib.from_torch(frozen).trainable_parameters() == {}


def test_state_dict_round_trip_through_torch_save_is_lossless():
    ours = seqlib.nn.EmbeddingBag(9, 4, mode="sum")
    buffer = io.BytesIO()
    torch.save({key: torch.from_numpy(value) for key, value in ours.torch_state_dict().items()}, buffer)
    buffer.seek(0)
    theirs = torch.nn.EmbeddingBag(9, 4, mode="sum")
    theirs.load_state_dict(torch.load(buffer))
    back = seqlib.nn.EmbeddingBag(9, 4, mode="sum").load_torch_state_dict(theirs.state_dict())
    assert np.array_equal(np.array(back.weight), np.array(ours.weight))
    from_numpy = seqlib.nn.EmbeddingBag(9, 4).load_torch_state_dict(ours.torch_state_dict())
    assert np.array_equal(np.array(from_numpy.weight), np.array(ours.weight))


def test_load_torch_state_dict_keeps_the_modules_dtype_and_checks_keys_and_shapes():
    table = seqlib.nn.Embedding(4, 2, dtype=mx.bfloat16)
    table.load_torch_state_dict({"weight": torch.arange(8.0).reshape(4, 2)})
    assert table.weight.dtype == mx.bfloat16 and table.torch_state_dict()["weight"].dtype == np.float32
    with pytest.raises(ValueError, match=r"missing keys \['weight'\]"):
        table.load_torch_state_dict({})
    with pytest.raises(ValueError, match=r"unexpected keys \['bias'\]"):
        table.load_torch_state_dict({"weight": np.zeros((4, 2)), "bias": np.zeros(2)})
    with pytest.raises(ValueError, match=r"expected shape \(4, 2\), got \(2, 4\)"):
        table.load_torch_state_dict({"weight": np.zeros((2, 4))})
    with pytest.raises(TypeError, match="list"):
        table.load_torch_state_dict({"weight": [[0.0, 0.0]] * 4})


def test_from_torch_names_what_it_can_convert():
    with pytest.raises(TypeError, match=r"torch\.nn\.Embedding.*got torch\.nn\.modules\.linear\.Linear"):
        seqlib.from_torch(torch.nn.Linear(2, 2))
