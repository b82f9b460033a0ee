"""seqlib.nn.Embedding and seqlib.functional.embedding against torch.nn.Embedding."""

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import loss_weights

import seqlib

from seqlib import functional as F


@st.composite
def lookups(draw):
    """A table size, an index array of 0-3 dims, and options, drawn together."""
    num_embeddings = draw(st.integers(1, 12))
    embedding_dim = draw(st.integers(1, 9))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    indices = rng.integers(0, num_embeddings, size=shape)
    padding_idx = draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1))
    max_norm = draw(st.none() | st.floats(0.1, 3.0))
    norm_type = draw(st.sampled_from([1.0, 2.0, 3.0, float("inf")]))
    index_dtype = draw(st.sampled_from([mx.int32, mx.int64, mx.uint32]))
    scale_grad_by_freq = draw(st.booleans())
    weight = rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32)
    return weight, indices, padding_idx, max_norm, norm_type, index_dtype, scale_grad_by_freq


@given(lookups())
def test_module_matches_torch_output_gradient_and_renormalised_weight(case):
    weight, indices, padding_idx, max_norm, norm_type, index_dtype, scale_grad_by_freq = case
    ours = seqlib.nn.Embedding.from_pretrained(
        mx.array(weight), freeze=False, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
        scale_grad_by_freq=scale_grad_by_freq,
    )  # fmt: skip
    theirs = torch.nn.Embedding.from_pretrained(
        torch.from_numpy(weight.copy()), freeze=False, padding_idx=padding_idx,
        max_norm=max_norm, norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq,
    )  # fmt: skip
    idx = mx.array(indices).astype(index_dtype)
    scale = loss_weights((*indices.shape, weight.shape[1]))

    def loss(model, idx):
        return (model(idx) * mx.array(scale)).sum()

    value, grads = mlx.nn.value_and_grad(ours, loss)(ours, idx)
    out_t = theirs(torch.from_numpy(indices))
    (out_t * torch.from_numpy(scale)).sum().backward()

    np.testing.assert_allclose(np.array(ours(idx)), out_t.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(value.item(), (out_t * torch.from_numpy(scale)).sum().item(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(grads["weight"]), theirs.weight.grad.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(ours.weight), theirs.weight.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_init_is_standard_normal_with_zero_padding_row():
    mx.random.seed(0)
    layer = seqlib.nn.Embedding(4000, 64, padding_idx=-3)
    weight = np.array(layer.weight)
    assert layer.padding_idx == 3997
    assert np.all(weight[3997] == 0)
    rest = np.delete(weight, 3997, axis=0)
    assert abs(rest.mean()) < 0.01 and abs(rest.std() - 1.0) < 0.01


def test_parameters_have_torchs_keys_and_freeze_means_frozen():
    from mlx.utils import tree_flatten

    layer = seqlib.nn.Embedding(5, 2)
    assert [key for key, _ in tree_flatten(layer.parameters())] == list(torch.nn.Embedding(5, 2).state_dict())
    frozen = seqlib.nn.Embedding.from_pretrained(mx.ones((3, 2)))
    assert tree_flatten(frozen.trainable_parameters()) == []
    assert tree_flatten(seqlib.nn.Embedding.from_pretrained(mx.ones((3, 2)), freeze=False).trainable_parameters())


def test_repeated_indices_accumulate_gradient():
    weight = mx.arange(8, dtype=mx.float32).reshape(4, 2)
    grad = mx.grad(lambda w: F.embedding(mx.array([1, 1, 3, 1]), w).sum())(weight)
    assert np.array(grad).tolist() == [[0, 0], [3, 3], [0, 0], [1, 1]]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_lookup_matches_float32(dtype):
    weight = mx.random.normal((7, 5), key=mx.random.key(1))
    idx = mx.array([[0, 6], [3, 3]])
    expected = np.array(F.embedding(idx, weight))
    got = np.array(F.embedding(idx, weight.astype(dtype)).astype(mx.float32))
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: F.embedding(mx.array([0, 5]), mx.zeros((5, 2))), IndexError, ["input", "[0, 5)", "5"]),
        (lambda: F.embedding(mx.array([-1]), mx.zeros((5, 2))), IndexError, ["input", "-1"]),
        (lambda: F.embedding(mx.array([0.0]), mx.zeros((5, 2))), TypeError, ["input", "integer", "float32"]),
        (lambda: F.embedding([0, 1], mx.zeros((5, 2))), TypeError, ["input", "list"]),
        (lambda: F.embedding(mx.array([0]), mx.zeros((5,))), ValueError, ["weight", "2-D", "(5,)"]),
        (lambda: seqlib.nn.Embedding(5, 2, padding_idx=5), ValueError, ["padding_idx", "[-5, 5)", "5"]),
        (lambda: seqlib.nn.Embedding(5, 2, max_norm=-0.5), ValueError, ["max_norm", ">= 0", "-0.5"]),
        (lambda: seqlib.nn.Embedding(-1, 2), ValueError, ["num_embeddings", "-1"]),
    ],
)
def test_bad_input_raises_a_clear_error_at_the_call(call, error, words):
    with pytest.raises(error) as raised:
        call()
    for word in words:
        assert word in str(raised.value)


def test_init_dtype_and_repr():
    layer = seqlib.nn.Embedding(4, 3, padding_idx=1, max_norm=2.0, scale_grad_by_freq=True, sparse=True,
                                dtype=mx.bfloat16)  # fmt: skip
    assert layer.weight.dtype == mx.bfloat16
    assert repr(layer) == "Embedding(4, 3, padding_idx=1, max_norm=2.0, scale_grad_by_freq=True, sparse=True)"
    with pytest.raises(TypeError, match="dtype"):
        seqlib.nn.Embedding(4, 3, dtype=mx.int32)


def test_works_with_mlx_optimizers_and_save_load_weights(tmp_path):
    import mlx.optimizers as optim

    layer = seqlib.nn.Embedding(6, 2, padding_idx=0)
    optimizer = optim.Adam(learning_rate=0.1)
    ids = mx.array([0, 1, 1, 4])
    before = np.array(layer.weight)
    for _ in range(3):
        _, grads = mlx.nn.value_and_grad(layer, lambda m: (m(ids) ** 2).sum())(layer)
        optimizer.update(layer, grads)
    after = np.array(layer.weight)
    assert np.all(after[0] == 0) and np.array_equal(after[2], before[2])
    assert not np.allclose(after[1], before[1])
    layer.save_weights(str(tmp_path / "table.safetensors"))
    restored = seqlib.nn.Embedding(6, 2).load_weights(str(tmp_path / "table.safetensors"))
    assert np.array_equal(np.array(restored.weight), after)
