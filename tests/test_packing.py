"""seqlib.nn.utils.rnn against torch.nn.utils.rnn: identical layouts, the same padding, gradients through both."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_reference import assert_close

from seqlib.nn.utils import rnn

LENGTH_KINDS = {"list": list, "numpy": np.array, "mlx": mx.array}


@st.composite
def padded_batches(draw):
    batch = draw(st.integers(1, 6))
    steps = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch))
    enforce_sorted = draw(st.booleans())
    if enforce_sorted:
        lengths.sort(reverse=True)
    return {
        "lengths": lengths,
        "steps": steps,
        "features": draw(st.sampled_from([(), (3,), (2, 2)])),
        "batch_first": draw(st.booleans()),
        "enforce_sorted": enforce_sorted,
        "lengths_kind": draw(st.sampled_from(sorted(LENGTH_KINDS))),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def padded_input(case):
    batch = len(case["lengths"])
    lead = (batch, case["steps"]) if case["batch_first"] else (case["steps"], batch)
    return np.random.default_rng(case["seed"]).standard_normal((*lead, *case["features"])).astype(np.float32)


def assert_same_layout(ours: rnn.PackedSequence, theirs) -> None:
    assert_close(ours.data, theirs.data, rtol=0, atol=0, what="data")
    np.testing.assert_array_equal(np.array(ours.batch_sizes), theirs.batch_sizes.numpy())
    assert ours.batch_sizes.dtype == mx.int64
    for name in ("sorted_indices", "unsorted_indices"):
        mine, reference = getattr(ours, name), getattr(theirs, name)
        assert (mine is None) == (reference is None), name
        if mine is not None:
            np.testing.assert_array_equal(np.array(mine), reference.numpy(), err_msg=name)
            assert mine.dtype == mx.int64


@given(padded_batches())
def test_pack_and_pad_match_torch_exactly(case):
    x = padded_input(case)
    lengths = LENGTH_KINDS[case["lengths_kind"]](case["lengths"])
    options = {"batch_first": case["batch_first"], "enforce_sorted": case["enforce_sorted"]}
    ours = rnn.pack_padded_sequence(mx.array(x), lengths, **options)
    theirs = torch.nn.utils.rnn.pack_padded_sequence(torch.from_numpy(x), case["lengths"], **options)
    assert_same_layout(ours, theirs)
    total_length = case["steps"] + 2
    padded, out_lengths = rnn.pad_packed_sequence(
        ours, batch_first=case["batch_first"], padding_value=-7.0, total_length=total_length
    )
    expected, expected_lengths = torch.nn.utils.rnn.pad_packed_sequence(
        theirs, batch_first=case["batch_first"], padding_value=-7.0, total_length=total_length
    )
    assert_close(padded, expected, rtol=0, atol=0)
    np.testing.assert_array_equal(np.array(out_lengths), expected_lengths.numpy())
    np.testing.assert_array_equal(ours.lengths(), case["lengths"])


@given(padded_batches())
def test_gradients_flow_through_pack_and_pad_as_in_torch(case):
    x = padded_input(case)
    options = {"batch_first": case["batch_first"], "enforce_sorted": case["enforce_sorted"]}
    weights = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def ours(x):
        packed = rnn.pack_padded_sequence(x, case["lengths"], **options)
        padded, _ = rnn.pad_packed_sequence(packed, batch_first=case["batch_first"], total_length=case["steps"])
        return (padded * mx.array(weights) + packed.data.sum()).sum()

    x_t = torch.from_numpy(x).requires_grad_()
    packed = torch.nn.utils.rnn.pack_padded_sequence(x_t, case["lengths"], **options)
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(
        packed, batch_first=case["batch_first"], total_length=case["steps"]
    )
    (padded * torch.from_numpy(weights) + packed.data.sum()).sum().backward()
    assert_close(mx.grad(ours)(mx.array(x)), x_t.grad, rtol=1e-6, atol=1e-6)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.booleans(), st.sampled_from(["right", "left"]))
def test_pad_pack_and_unpack_sequence_match_torch(lengths, batch_first, padding_side):
    rng = np.random.default_rng(len(lengths))
    arrays = [rng.standard_normal((length, 2)).astype(np.float32) for length in lengths]
    ours = rnn.pad_sequence([mx.array(a) for a in arrays], batch_first, -1.0, padding_side)
    theirs = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(a) for a in arrays], batch_first, -1.0, padding_side)
    assert_close(ours, theirs, rtol=0, atol=0)
    packed = rnn.pack_sequence([mx.array(a) for a in arrays], enforce_sorted=False)
    packed_t = torch.nn.utils.rnn.pack_sequence([torch.from_numpy(a) for a in arrays], enforce_sorted=False)
    assert_same_layout(packed, packed_t)
    for mine, original in zip(rnn.unpack_sequence(packed), arrays, strict=True):
        np.testing.assert_array_equal(np.array(mine), original)


def test_the_packed_layout_is_time_major_with_batch_sizes_per_step():
    sequences = [mx.array([[1.0], [2.0], [3.0], [4.0]]), mx.array([[5.0], [6.0]]), mx.array([[7.0]])]
    packed = rnn.pack_sequence(sequences)
    assert np.array(packed.data).ravel().tolist() == [1, 5, 7, 2, 6, 3, 4]
    assert np.array(packed.batch_sizes).tolist() == [3, 2, 1, 1]
    assert packed.sorted_indices is None and packed.unsorted_indices is None


BAD_CALLS = [
    (lambda: rnn.pack_padded_sequence(mx.zeros((4, 3, 2)), [4, 2]), ValueError, r"lengths.*\(3\), got 2"),
    (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 2)), [5, 2]), ValueError, r"lengths.*\[1, 4\].*5"),
    (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 2)), [4, 0]), ValueError, r"lengths.*\[1, 4\].*0"),
    (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 2)), [2, 4]), ValueError, "decreasing.*enforce_sorted=False"),
    (lambda: rnn.pack_padded_sequence(mx.zeros((4, 2, 2)), [2.0, 4.0]), TypeError, "lengths.*ints"),
    (lambda: rnn.pack_padded_sequence(np.zeros((4, 2, 2)), [4, 2]), TypeError, "input"),
    (lambda: rnn.pack_padded_sequence(mx.zeros((4,)), [4]), ValueError, "at least 2 dimensions"),
    (lambda: rnn.pad_packed_sequence(rnn.pack_sequence([mx.zeros((3, 1))]), total_length=2), ValueError,
     "total_length.*3.*2"),
    (lambda: rnn.pad_packed_sequence((mx.zeros((3, 1)), mx.array([1, 1, 1]))), TypeError, "PackedSequence"),
    (lambda: rnn.pad_sequence([mx.zeros((3, 1)), mx.zeros((2, 2))]), ValueError, "trailing shape"),
    (lambda: rnn.pad_sequence([mx.zeros((3, 1))], padding_side="middle"), ValueError, "padding_side"),
    (lambda: rnn.pad_sequence([]), TypeError, "non-empty"),
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", BAD_CALLS)
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
