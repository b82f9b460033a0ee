"""Switching between mlx.nn's recurrent layers and seqlib's: the folded biases unfold and fold back."""

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest

import seqlib
from seqlib.interop import from_mlx, to_mlx

CASES = [
    (lambda: mlx.nn.RNN(3, 5), "tanh"),
    (lambda: mlx.nn.RNN(3, 5, nonlinearity=mlx.nn.relu), "relu"),
    (lambda: mlx.nn.RNN(3, 5, bias=False), "tanh"),
    (lambda: mlx.nn.LSTM(3, 5), None),
    (lambda: mlx.nn.LSTM(3, 5, bias=False), None),
    (lambda: mlx.nn.GRU(3, 5), None),
    (lambda: mlx.nn.GRU(3, 5, bias=False), None),
]


def all_hidden_states(layer, x):
    """What mlx.nn's layers return (every step's h), from a seqlib layer's output."""
    output, _ = layer(x)
    return output


@pytest.mark.parametrize("make, nonlinearity", CASES)
def test_a_converted_mlx_layer_computes_the_same_sequence(make, nonlinearity):
    mx.random.seed(0)
    theirs = make()
    x = mx.random.normal((2, 7, 3))  # batch-first, as mlx.nn
    ours = from_mlx(theirs)
    assert ours.batch_first and ours.bias == (len(theirs.parameters()) > 2)
    if nonlinearity:
        assert ours.nonlinearity == nonlinearity
    expected = theirs(x)[0] if isinstance(theirs, mlx.nn.LSTM) else theirs(x)
    np.testing.assert_allclose(np.array(all_hidden_states(ours, x)), np.array(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make, nonlinearity", CASES)
def test_to_mlx_folds_the_biases_back(make, nonlinearity):
    mx.random.seed(1)
    kind = type(make()).__name__
    options = {"bias": len(make().parameters()) > 2} | ({"nonlinearity": nonlinearity} if nonlinearity else {})
    ours = getattr(seqlib.nn, kind)(3, 5, batch_first=True, **options)
    theirs = to_mlx(ours)
    assert type(theirs) is getattr(mlx.nn, kind)
    x = mx.random.normal((2, 7, 3))
    expected = theirs(x)[0] if kind == "LSTM" else theirs(x)
    np.testing.assert_allclose(np.array(all_hidden_states(ours, x)), np.array(expected), rtol=1e-5, atol=1e-6)
    again = from_mlx(theirs)  # b_hh is folded into b_ih, but the function is the same
    np.testing.assert_allclose(np.array(again(x)[0]), np.array(ours(x)[0]), rtol=1e-5, atol=1e-6)


def test_conversions_refuse_what_the_other_side_cannot_express():
    with pytest.raises(ValueError, match="num_layers=2"):
        to_mlx(seqlib.nn.LSTM(3, 4, num_layers=2))
    with pytest.raises(ValueError, match="bidirectional=True"):
        to_mlx(seqlib.nn.GRU(3, 4, bidirectional=True))
    with pytest.raises(ValueError, match="proj_size=2"):
        to_mlx(seqlib.nn.LSTM(3, 4, proj_size=2))
    with pytest.raises(TypeError, match=r"mlx\.nn\.RNN"):
        from_mlx(mlx.nn.Linear(3, 4))
    with pytest.raises(ValueError, match="nonlinearity"):
        from_mlx(mlx.nn.RNN(3, 4, nonlinearity=mlx.nn.sigmoid))
    with pytest.raises(TypeError, match=r"seqlib\.nn\.RNN"):
        to_mlx(mlx.nn.LSTM(3, 4))
