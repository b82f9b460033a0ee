"""seqlib.activations: the rational tanh and sigmoid against float64, over every float32 region that matters."""

import mlx.core as mx
import numpy as np
import pytest

from seqlib.activations import TANH_CLIP, fast_sigmoid, fast_tanh


def float32_grid():
    dense = np.linspace(-20, 20, 400_001)
    tiny = np.geomspace(1e-38, 1e-2, 2000)
    huge = np.geomspace(10, 3e38, 2000)
    return np.concatenate([dense, tiny, -tiny, huge, -huge, [0.0, TANH_CLIP]]).astype(np.float32)


def test_fast_tanh_is_within_3_8e_7_absolute_and_relative_everywhere():
    x = float32_grid()
    exact = np.tanh(x.astype(np.float64))
    got = np.array(mx.compile(fast_tanh)(mx.array(x))).astype(np.float64)
    error = np.abs(got - exact)
    assert error.max() <= 3.8e-7
    assert (error / np.maximum(np.abs(exact), 1e-38)).max() <= 3.8e-7
    assert np.all(np.abs(got) <= 1.0)


def test_fast_sigmoid_is_within_2_4e_7_absolute():
    x = float32_grid()
    exact = 1 / (1 + np.exp(-np.clip(x.astype(np.float64), -700, 700)))
    got = np.array(fast_sigmoid(mx.array(x))).astype(np.float64)
    assert np.abs(got - exact).max() <= 2.4e-7
    assert got.min() >= 0.0 and got.max() <= 1.0


@pytest.mark.parametrize("value, expected", [(np.inf, 1.0), (-np.inf, -1.0), (1e30, 1.0), (-1e30, -1.0), (0.0, 0.0)])
def test_fast_tanh_saturates_exactly_and_never_overflows(value, expected):
    assert np.array(fast_tanh(mx.array([value], dtype=mx.float32)))[0] == expected


def test_fast_tanh_keeps_nan_and_odd_symmetry():
    assert np.isnan(np.array(fast_tanh(mx.array([np.nan], dtype=mx.float32)))[0])
    x = mx.array(np.linspace(0, 10, 1001).astype(np.float32))
    np.testing.assert_array_equal(np.array(fast_tanh(-x)), -np.array(fast_tanh(x)))


@pytest.mark.parametrize("dtype, tolerance", [(mx.float16, 1e-3), (mx.bfloat16, 4e-3)])
def test_half_precision_inputs_keep_their_dtype(dtype, tolerance):
    x = mx.array(np.linspace(-6, 6, 101).astype(np.float32)).astype(dtype)
    got = fast_tanh(x)
    assert got.dtype == dtype
    exact = np.tanh(np.array(x.astype(mx.float32)).astype(np.float64))
    assert np.abs(np.array(got.astype(mx.float32)) - exact).max() <= tolerance
