"""seqlib.reference's embedding functions against torch.nn.functional: lookups, bags, renormalisation, gradients."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from seqlib import reference as ref

MODE_NUMBER = {"sum": 0, "mean": 1, "max": 2}  # torch._embedding_bag's mode argument
NORM_TYPES = (1.0, 2.0, 3.0, math.inf)


def torch_leaf(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.copy()).requires_grad_(True)


def draw_padding_idx(draw, num_embeddings: int):
    return draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1))


# ---------------------------------------------------------------- embedding


@st.composite
def lookups(draw):
    num_embeddings, embedding_dim = draw(st.integers(1, 7)), draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    return {
        "num_embeddings": num_embeddings,
        "embedding_dim": embedding_dim,
        "shape": shape,
        "padding_idx": draw_padding_idx(draw, num_embeddings),
        "scale_grad_by_freq": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@given(lookups())
def test_embedding_and_its_backward_match_torch(case):
    rng = np.random.default_rng(case["seed"])
    weight = rng.standard_normal((case["num_embeddings"], case["embedding_dim"]))
    indices = rng.integers(0, case["num_embeddings"], case["shape"])  # small tables: repeated indices
    d_out = rng.standard_normal((*case["shape"], case["embedding_dim"]))
    options = {"padding_idx": case["padding_idx"], "scale_grad_by_freq": case["scale_grad_by_freq"]}

    weight_t = torch_leaf(weight)
    out_t = F.embedding(torch.from_numpy(indices), weight_t, **options)
    (out_t * torch.from_numpy(d_out)).sum().backward()

    out = ref.embedding(indices, weight, case["padding_idx"])
    d_weight = ref.embedding_backward(d_out, indices, case["num_embeddings"], **options)
    np.testing.assert_array_equal(out, out_t.detach().numpy())
    np.testing.assert_allclose(d_weight, weight_t.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_embedding_backward_keeps_the_dtype_of_d_out_and_zeroes_the_padding_row():
    d_out = np.ones((2, 3, 2), np.float32)
    indices = np.array([[1, 1, 2], [0, 1, 0]])
    d_weight = ref.embedding_backward(d_out, indices, 4, padding_idx=-4, scale_grad_by_freq=True)
    assert d_weight.dtype == np.float32
    np.testing.assert_array_equal(d_weight, [[0, 0], [1, 1], [1, 1], [0, 0]])  # 3 lookups of row 1, each 1/3


# ---------------------------------------------------------------- renorm


@st.composite
def renorms(draw):
    num_embeddings = draw(st.integers(1, 7))
    return {
        "num_embeddings": num_embeddings,
        "embedding_dim": draw(st.integers(1, 5)),
        "shape": tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=2))),
        "max_norm": draw(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
        "norm_type": draw(st.sampled_from(NORM_TYPES)),
        "dtype": draw(st.sampled_from([np.float64, np.float32])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@given(renorms())
def test_embedding_renorm_matches_torch_embedding_with_max_norm(case):
    rng = np.random.default_rng(case["seed"])
    weight = (2 * rng.standard_normal((case["num_embeddings"], case["embedding_dim"]))).astype(case["dtype"])
    indices = rng.integers(0, case["num_embeddings"], case["shape"])
    weight_t = torch.from_numpy(weight.copy())  # renormalised in place by the lookup
    F.embedding(torch.from_numpy(indices), weight_t, max_norm=case["max_norm"], norm_type=case["norm_type"])

    renormed = ref.embedding_renorm(weight, indices, case["max_norm"], case["norm_type"])
    assert renormed.dtype == weight.dtype
    tolerance = 1e-12 if case["dtype"] == np.float64 else 1e-6
    np.testing.assert_allclose(renormed, weight_t.numpy(), rtol=tolerance, atol=tolerance)
    untouched = np.setdiff1d(np.arange(case["num_embeddings"]), indices)
    np.testing.assert_array_equal(renormed[untouched], weight[untouched])


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_embedding_renorm_rescales_rows_just_over_max_norm_only(norm_type):
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((6, 4))
    norms = np.linalg.norm(rows, ord=norm_type, axis=1, keepdims=True)
    weight = rows / norms * np.array([0.9, 0.999, 0.99999, 1.00001, 1.001, 1.1])[:, None]  # norms around 1
    weight_t = torch.from_numpy(weight.copy())
    F.embedding(torch.arange(6), weight_t, max_norm=1.0, norm_type=norm_type)

    renormed = ref.embedding_renorm(weight, np.arange(6), 1.0, norm_type)
    np.testing.assert_allclose(renormed, weight_t.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(renormed[:3], weight[:3])
    np.testing.assert_allclose(np.linalg.norm(renormed[3:], ord=norm_type, axis=1), 1.0, rtol=1e-6)


def test_embedding_renorm_returns_a_copy_and_leaves_weight_alone():
    weight = np.array([[3.0, 4.0], [0.3, 0.4]])
    renormed = ref.embedding_renorm(weight, np.array([0, 1, 0]), max_norm=1.0)
    np.testing.assert_allclose(renormed, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    np.testing.assert_array_equal(weight, [[3.0, 4.0], [0.3, 0.4]])


# ---------------------------------------------------------------- embedding_bag


@st.composite
def bag_cases(draw, mode: str):
    """A 1-D input with offsets (possibly empty bags) or a 2-D input, and every option torch combines with it."""
    num_embeddings, embedding_dim = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    two_d = draw(st.booleans())
    if two_d:
        shape = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))  # torch 2.13 fails on (B, 0)
        bag_sizes = [shape[1]] * shape[0]
    else:
        bag_sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
        shape = (sum(bag_sizes),)
    return {
        "num_embeddings": num_embeddings,
        "embedding_dim": embedding_dim,
        "mode": mode,
        "shape": shape,
        "bag_sizes": bag_sizes,
        "include_last_offset": not two_d and draw(st.booleans()),
        "padding_idx": draw_padding_idx(draw, num_embeddings),
        "weighted": mode == "sum" and draw(st.booleans()),
        "dtype": draw(st.sampled_from([np.float64, np.float32])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def bag_arguments(case):
    """NumPy arrays for one case: weight, input, offsets (None for 2-D input), per_sample_weights, d_out."""
    rng = np.random.default_rng(case["seed"])
    weight = rng.standard_normal((case["num_embeddings"], case["embedding_dim"])).astype(case["dtype"])
    indices = rng.integers(0, case["num_embeddings"], case["shape"])
    offsets = None
    if len(case["shape"]) == 1:
        bounds = np.concatenate([[0], np.cumsum(case["bag_sizes"])])
        offsets = bounds if case["include_last_offset"] else bounds[:-1]
    sample_weights = rng.standard_normal(case["shape"]).astype(case["dtype"]) if case["weighted"] else None
    d_out = rng.standard_normal((len(case["bag_sizes"]), case["embedding_dim"])).astype(case["dtype"])
    return weight, indices, offsets, sample_weights, d_out


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@given(data=st.data())
def test_embedding_bag_and_its_backward_match_torch(mode, data):
    case = data.draw(bag_cases(mode))
    weight, indices, offsets, sample_weights, d_out = bag_arguments(case)
    options = {"mode": case["mode"], "include_last_offset": case["include_last_offset"],
               "padding_idx": case["padding_idx"]}  # fmt: skip

    weight_t = torch_leaf(weight)
    sample_weights_t = None if sample_weights is None else torch_leaf(sample_weights)
    offsets_t = None if offsets is None else torch.from_numpy(offsets)
    out_t = F.embedding_bag(torch.from_numpy(indices), weight_t, offsets_t, per_sample_weights=sample_weights_t,
                            **options)  # fmt: skip
    (out_t * torch.from_numpy(d_out)).sum().backward()

    out, max_entry = ref.embedding_bag(indices, weight, offsets, per_sample_weights=sample_weights, **options)
    d_weight, d_sample_weights = ref.embedding_bag_backward(
        d_out, indices, offsets, case["num_embeddings"], per_sample_weights=sample_weights, weight=weight, **options
    )
    close = {"rtol": 1e-12, "atol": 1e-12} if case["dtype"] == np.float64 else {"rtol": 1e-5, "atol": 1e-5}
    assert out.dtype == d_weight.dtype == case["dtype"]
    np.testing.assert_allclose(out, out_t.detach().numpy(), **close)
    np.testing.assert_allclose(d_weight, weight_t.grad.numpy(), **close)
    if sample_weights is None:
        assert d_sample_weights is None
    else:
        assert d_sample_weights.shape == indices.shape
        np.testing.assert_allclose(d_sample_weights, sample_weights_t.grad.numpy(), **close)

    num_bags = len(case["bag_sizes"])
    bag_of_entry = np.repeat(np.arange(num_bags), case["bag_sizes"])
    counted = np.ones(indices.size, bool) if case["padding_idx"] is None else (
        indices.reshape(-1) != case["padding_idx"] % case["num_embeddings"])  # fmt: skip
    empty = np.bincount(bag_of_entry[counted], minlength=num_bags) == 0
    if case["mode"] != "max":
        assert np.all(max_entry == -1)
        return
    assert np.all(max_entry[empty] == -1)
    # torch's own record of the winners holds rows of the table, ours positions in input
    torch_rows = torch._embedding_bag(
        weight_t.detach(), torch.from_numpy(indices.reshape(-1)),
        torch.from_numpy(np.cumsum([0, *case["bag_sizes"][:-1]])), False, MODE_NUMBER["max"], False, None, False,
        -1 if case["padding_idx"] is None else case["padding_idx"] % case["num_embeddings"],
    )[3].numpy()  # fmt: skip
    np.testing.assert_array_equal(indices.reshape(-1)[max_entry[~empty]], torch_rows[~empty])


def test_embedding_bag_max_follows_torch_with_nans_and_ties():
    weight = np.array([[np.nan, 1.0], [2.0, np.nan], [3.0, 1.0], [2.0, 1.0]])
    indices, offsets = np.array([0, 1, 2, 1, 0, 2, 3, 2]), np.array([0, 3, 6])
    out_t = F.embedding_bag(torch.from_numpy(indices), torch.from_numpy(weight), torch.from_numpy(offsets), mode="max")

    out, max_entry = ref.embedding_bag(indices, weight, offsets, mode="max")
    np.testing.assert_array_equal(out, out_t.numpy())  # NaNs in the same places
    np.testing.assert_array_equal(out, [[np.nan, 1.0], [3.0, np.nan], [3.0, 1.0]])
    # a NaN wins as the first entry only (later ones are skipped); of equal values the first wins
    np.testing.assert_array_equal(max_entry, [[0, 0], [5, 3], [7, 6]])


def test_embedding_bag_2d_input_with_no_columns_and_empty_offsets_give_zeros():
    weight = np.ones((3, 2), np.float32)
    for mode in ("sum", "mean", "max"):
        out, max_entry = ref.embedding_bag(np.zeros((4, 0), np.int64), weight, mode=mode)  # torch 2.13 fails here
        assert out.shape == (4, 2) and out.dtype == np.float32 and not out.any()
        assert np.all(max_entry == -1)
    out, _ = ref.embedding_bag(np.array([1, 2]), weight, np.zeros(0, np.int64))  # torch crashes here: no bags
    assert out.shape == (0, 2)


def test_embedding_bag_backward_of_an_empty_bag_and_of_padding_is_zero():
    weight = np.arange(8.0).reshape(4, 2)
    indices, offsets, psw = np.array([3, 1, 3]), np.array([0, 0, 2]), np.array([2.0, 5.0, 7.0])
    d_out = np.ones((3, 2))
    d_weight, d_psw = ref.embedding_bag_backward(d_out, indices, offsets, 4, "sum", psw, padding_idx=3, weight=weight)
    np.testing.assert_array_equal(d_weight, [[0, 0], [5, 5], [0, 0], [0, 0]])
    np.testing.assert_array_equal(d_psw, [0.0, 5.0, 0.0])  # d psw[1] = d_out[1] · weight[1] = 2 + 3


# ---------------------------------------------------------------- bad input


W = np.zeros((4, 3))
IDX = np.array([0, 1, 2])
OFF = np.array([0, 2])
D_BAGS = np.zeros((2, 3))

BAD_CALLS = {
    "list input": (lambda: ref.embedding([0, 1], W), TypeError, "input"),
    "float input": (lambda: ref.embedding(np.array([0.0]), W), TypeError, "input: expected an integer dtype"),
    "bool input": (lambda: ref.embedding(np.array([True]), W), TypeError, "input"),
    "1-D weight": (lambda: ref.embedding(IDX, np.zeros(4)), ValueError, "weight: expected a 2-D"),
    "int weight": (lambda: ref.embedding(IDX, np.zeros((4, 3), int)), TypeError, "weight: expected a floating"),
    "index too large": (lambda: ref.embedding(np.array([4]), W), IndexError, "input: every index must lie in"),
    "negative index": (lambda: ref.embedding(np.array([-1]), W), IndexError, "input"),
    "padding_idx out of range": (lambda: ref.embedding(IDX, W, padding_idx=4), ValueError, "padding_idx"),
    "backward index": (lambda: ref.embedding_backward(np.zeros((1, 3)), np.array([9]), 4), IndexError, "input"),
    "backward d_out shape": (lambda: ref.embedding_backward(np.zeros((2, 3)), IDX, 4), ValueError, "d_out"),
    "backward d_out int": (lambda: ref.embedding_backward(np.zeros((3, 3), int), IDX, 4), TypeError, "d_out"),
    "backward num_embeddings": (lambda: ref.embedding_backward(np.zeros((3, 3)), IDX, -1), ValueError,
                                "num_embeddings"),
    "renorm index": (lambda: ref.embedding_renorm(W, np.array([4]), 1.0), IndexError, "input"),
    "renorm max_norm None": (lambda: ref.embedding_renorm(W, IDX, None), TypeError, "max_norm"),
    "renorm negative max_norm": (lambda: ref.embedding_renorm(W, IDX, -1.0), ValueError, "max_norm"),
    "renorm norm_type 0": (lambda: ref.embedding_renorm(W, IDX, 1.0, 0.0), ValueError, "norm_type"),
    "bag mode": (lambda: ref.embedding_bag(IDX, W, OFF, mode="min"), ValueError, "mode"),
    "bag index": (lambda: ref.embedding_bag(np.array([0, 5]), W, OFF), IndexError, "input"),
    "bag no offsets": (lambda: ref.embedding_bag(IDX, W), ValueError, "offsets: required"),
    "bag 2-D with offsets": (lambda: ref.embedding_bag(IDX[None], W, OFF), ValueError, "offsets: must be None"),
    "bag 3-D input": (lambda: ref.embedding_bag(np.zeros((1, 1, 1), int), W), ValueError, "input"),
    "bag float offsets": (lambda: ref.embedding_bag(IDX, W, np.array([0.0])), TypeError, "offsets"),
    "bag offsets not from 0": (lambda: ref.embedding_bag(IDX, W, np.array([1, 2])), ValueError, "offsets"),
    "bag offsets decreasing": (lambda: ref.embedding_bag(IDX, W, np.array([0, 2, 1])), ValueError, "offsets"),
    "bag offsets past end": (lambda: ref.embedding_bag(IDX, W, np.array([0, 4])), ValueError, "offsets"),
    "bag last offset short": (lambda: ref.embedding_bag(IDX, W, OFF, include_last_offset=True), ValueError,
                              "include_last_offset"),
    "bag weights in mean": (lambda: ref.embedding_bag(IDX, W, OFF, "mean", np.ones(3)), ValueError,
                            "per_sample_weights: only supported with mode='sum'"),
    "bag weights shape": (lambda: ref.embedding_bag(IDX, W, OFF, "sum", np.ones(2)), ValueError,
                          "per_sample_weights: expected the shape"),
    "bag weights int": (lambda: ref.embedding_bag(IDX, W, OFF, "sum", np.ones(3, int)), TypeError,
                        "per_sample_weights"),
    "bag padding_idx": (lambda: ref.embedding_bag(IDX, W, OFF, padding_idx=-5), ValueError, "padding_idx"),
    "bag backward max without weight": (lambda: ref.embedding_bag_backward(D_BAGS, IDX, OFF, 4, "max"), ValueError,
                                        "weight: required for mode='max'"),
    "bag backward weights without weight": (
        lambda: ref.embedding_bag_backward(D_BAGS, IDX, OFF, 4, "sum", np.ones(3)), ValueError, "weight: required"),
    "bag backward d_out rows": (lambda: ref.embedding_bag_backward(np.zeros((3, 3)), IDX, OFF, 4), ValueError,
                                "d_out: expected one row per bag"),
    "bag backward d_out 1-D": (lambda: ref.embedding_bag_backward(np.zeros(3), IDX, OFF, 4), ValueError, "d_out"),
    "bag backward weight shape": (lambda: ref.embedding_bag_backward(D_BAGS, IDX, OFF, 4, "max", weight=W[:3]),
                                  ValueError, "weight: expected shape"),
    "bag backward index": (lambda: ref.embedding_bag_backward(D_BAGS, np.array([0, 4]), OFF, 4), IndexError, "input"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_raises_naming_the_argument(name):
    call, error, words = BAD_CALLS[name]
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        call()
