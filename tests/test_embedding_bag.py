"""seqlib.nn.EmbeddingBag and seqlib.functional.embedding_bag against torch."""

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import assert_close, loss_weights, to_torch

import seqlib
from seqlib import functional as F


@st.composite
def bag_cases(draw):
    num_embeddings = draw(st.integers(1, 10))
    embedding_dim = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    two_d = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if two_d:
        shape = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
        indices = rng.integers(0, num_embeddings, size=shape)
        offsets = None
        include_last_offset = draw(st.booleans())  # ignored for 2-D input, as in torch
    else:
        lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
        indices = rng.integers(0, num_embeddings, size=sum(lengths))
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        include_last_offset = draw(st.booleans())
        if include_last_offset:
            offsets = np.append(offsets, sum(lengths))
    return {
        "weight": rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32),
        "indices": indices,
        "offsets": offsets,
        "mode": mode,
        "include_last_offset": include_last_offset,
        "padding_idx": draw(st.none() | st.integers(-num_embeddings, num_embeddings - 1)),
        "max_norm": draw(st.none() | st.floats(0.2, 3.0)),
        "norm_type": draw(st.sampled_from([1.0, 2.0, float("inf")])),
        "per_sample_weights": (
            rng.uniform(-2, 2, size=indices.shape).astype(np.float32) if mode == "sum" and draw(st.booleans())
            else None
        ),
        "index_dtype": draw(st.sampled_from([mx.int32, mx.int64, mx.uint32])),
    }


def run_torch(case):
    bag = torch.nn.EmbeddingBag.from_pretrained(
        torch.from_numpy(case["weight"].copy()), freeze=False, max_norm=case["max_norm"],
        norm_type=case["norm_type"], mode=case["mode"], include_last_offset=case["include_last_offset"],
        padding_idx=case["padding_idx"],
    )  # fmt: skip
    psw = case["per_sample_weights"]
    psw = torch.from_numpy(psw).requires_grad_() if psw is not None else None
    offsets = torch.from_numpy(case["offsets"]) if case["offsets"] is not None else None
    out = bag(torch.from_numpy(case["indices"]), offsets, per_sample_weights=psw)
    return bag, out, psw


@given(bag_cases())
def test_matches_torch_output_gradients_and_renormalised_weight(case):
    theirs, out_t, psw_t = run_torch(case)
    ours = seqlib.nn.EmbeddingBag.from_pretrained(
        mx.array(case["weight"]), freeze=False, max_norm=case["max_norm"], norm_type=case["norm_type"],
        mode=case["mode"], include_last_offset=case["include_last_offset"], padding_idx=case["padding_idx"],
    )  # fmt: skip
    indices = mx.array(case["indices"]).astype(case["index_dtype"])
    offsets = mx.array(case["offsets"]) if case["offsets"] is not None else None
    psw = mx.array(case["per_sample_weights"]) if case["per_sample_weights"] is not None else None
    scale = loss_weights(tuple(out_t.shape))

    def loss(model, psw):
        return (model(indices, offsets, psw) * mx.array(scale)).sum()

    _, grads = mlx.nn.value_and_grad(ours, loss)(ours, psw)
    (out_t * torch.from_numpy(scale)).sum().backward()
    assert_close(ours(indices, offsets, psw), out_t, what="output")
    assert_close(grads["weight"], theirs.weight.grad, what="weight gradient")
    assert_close(ours.weight, theirs.weight, what="renormalised weight")
    if psw is not None:
        psw_grad = mx.grad(lambda p: loss(ours, p))(psw)
        assert_close(psw_grad, psw_t.grad, rtol=1e-5, atol=1e-5, what="per_sample_weights gradient")


@given(bag_cases())
def test_scale_grad_by_freq_divides_each_rows_gradient_by_its_frequency_in_the_batch(case):
    """Every entry of index v gets the same scale 1 / count(v), so the table gradient is the
    unscaled one (checked against torch above) divided row by row by the counts.

    (torch 2.13's CPU EmbeddingBag reads the count of the wrong index for some batches; its
    Embedding, and EmbeddingBag on CUDA, follow this rule.)
    """
    case = {**case, "max_norm": None, "mode": "sum" if case["mode"] == "max" else case["mode"]}
    theirs, out_t, _ = run_torch(case)
    scale = loss_weights(tuple(out_t.shape))
    (out_t * torch.from_numpy(scale)).sum().backward()
    counts = np.bincount(case["indices"].reshape(-1), minlength=len(case["weight"]))
    expected = theirs.weight.grad.numpy() / np.maximum(counts, 1)[:, None]

    ours = seqlib.nn.EmbeddingBag.from_pretrained(
        mx.array(case["weight"]), freeze=False, mode=case["mode"], include_last_offset=case["include_last_offset"],
        padding_idx=case["padding_idx"], scale_grad_by_freq=True,
    )  # fmt: skip
    indices = mx.array(case["indices"])
    offsets = mx.array(case["offsets"]) if case["offsets"] is not None else None
    psw = mx.array(case["per_sample_weights"]) if case["per_sample_weights"] is not None else None
    loss = lambda model: (model(indices, offsets, psw) * mx.array(scale)).sum()
    grads = mlx.nn.value_and_grad(ours, loss)(ours)[1]
    assert_close(grads["weight"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_empty_and_all_padding_bags_give_zeros(mode):
    weight = mx.random.normal((5, 3), key=mx.random.key(0))
    out = F.embedding_bag(mx.array([2, 2, 1, 4]), weight, mx.array([0, 0, 2, 2]), mode=mode, padding_idx=2)
    assert np.array(out[0]).tolist() == [0, 0, 0]  # empty
    assert np.array(out[1]).tolist() == [0, 0, 0]  # only padding
    assert np.array(out[2]).tolist() == [0, 0, 0]  # empty
    assert np.all(np.array(out[3]) != 0)


def test_max_mode_sends_the_gradient_to_the_first_arg_max_only():
    weight = mx.ones((3, 2))
    grad = mx.grad(lambda w: F.embedding_bag(mx.array([0, 1, 2]), w, mx.array([0]), mode="max").sum())(weight)
    assert np.array(grad).tolist() == [[1, 1], [0, 0], [0, 0]]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_half_precision_bags_match_float32(dtype, mode):
    weight = mx.random.normal((20, 8), key=mx.random.key(3))
    indices, offsets = mx.array([1, 5, 5, 19, 0, 3]), mx.array([0, 3, 3])
    expected = F.embedding_bag(indices, weight, offsets, mode=mode)
    got = F.embedding_bag(indices, weight.astype(dtype), offsets, mode=mode)
    assert got.dtype == dtype
    tolerance = 2e-2 if dtype == mx.bfloat16 else 5e-3
    assert_close(got, to_torch(expected), rtol=tolerance, atol=tolerance)


W = mx.zeros((5, 2))


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([1])), ValueError, ["offsets", "start at 0", "1"]),
        (lambda: F.embedding_bag(mx.array([0, 1, 2]), W, mx.array([0, 2, 1])), ValueError,
         ["offsets", "non-decreasing", "2", "1"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([0, 3])), ValueError, ["offsets", "length 2", "3"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([0.0])), TypeError, ["offsets", "integer"]),
        (lambda: F.embedding_bag(mx.array([[0, 1]]), W, mx.array([0])), ValueError, ["offsets", "2-D", "None"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W), ValueError, ["offsets", "1-D", "None"]),
        (lambda: F.embedding_bag(mx.zeros((1, 1, 1), mx.int32), W), ValueError, ["input", "(1, 1, 1)"]),
        (lambda: F.embedding_bag(mx.array([0, 5]), W, mx.array([0])), IndexError, ["input", "[0, 5)", "5"]),
        (lambda: F.embedding_bag(mx.array([0, -1]), W, mx.array([0])), IndexError, ["input", "-1"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([0]), mode="mean", per_sample_weights=mx.ones(2)),
         ValueError, ["per_sample_weights", "sum", "mean"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([0]), mode="sum", per_sample_weights=mx.ones(3)),
         ValueError, ["per_sample_weights", "(2,)", "(3,)"]),
        (lambda: F.embedding_bag(mx.array([0, 1]), W, mx.array([0]), mode="avg"), ValueError, ["mode", "avg"]),
        (lambda: seqlib.nn.EmbeddingBag(5, 2, padding_idx=-6), ValueError, ["padding_idx", "-6"]),
        (lambda: seqlib.nn.EmbeddingBag(5, 2, max_norm=-1.0), ValueError, ["max_norm", "-1.0"]),
        (lambda: seqlib.nn.EmbeddingBag(5, 2, mode="median"), ValueError, ["mode", "median"]),
        (lambda: seqlib.nn.EmbeddingBag(5, 2, mode="max", sparse=True), ValueError, ["sparse", "max"]),
        (lambda: seqlib.nn.EmbeddingBag(5, 2, mode="max", scale_grad_by_freq=True), ValueError,
         ["scale_grad_by_freq", "max"]),
    ],
)
def test_bad_input_raises_a_clear_error_at_the_call(call, error, words):
    with pytest.raises(error) as raised:
        call()
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


def test_validation_is_a_small_part_of_a_large_call():
    """Checking 1M indices and 100k offsets must stay cheap next to the work itself."""
    import time

    rng = np.random.default_rng(0)
    weight = mx.random.normal((100_000, 16))
    lengths = rng.integers(1, 20, size=100_000)
    indices = mx.array(rng.integers(0, 100_000, size=int(lengths.sum())).astype(np.int32))
    offsets = mx.array(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32))
    mx.eval(weight, indices, offsets)
    start = time.perf_counter()
    mx.eval(F.embedding_bag(indices, weight, offsets, mode="sum"))
    total = time.perf_counter() - start
    start = time.perf_counter()
    bounds = seqlib._bags.bag_bounds(offsets, indices.size, False)  # the checks every path makes
    seqlib._checks.check_index_range(indices, 100_000, "input")
    checks = time.perf_counter() - start
    assert bounds.size == 100_001
    assert checks < 0.5 * total + 0.05, f"checks {checks:.3f}s of {total:.3f}s"
