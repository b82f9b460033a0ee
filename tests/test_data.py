"""seqlib.data: the adding problem and the Python-source corpus."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlib import data


@given(num_sequences=st.integers(1, 40), length=st.integers(2, 60), seed=st.integers(0, 2**32 - 1))
def test_adding_problem_marks_one_step_in_each_half_and_sums_them(num_sequences, length, seed):
    inputs, targets = data.adding_problem(num_sequences, length, seed)
    assert inputs.shape == (num_sequences, length, 2) and inputs.dtype == mx.float32
    assert targets.shape == (num_sequences,) and targets.dtype == mx.float32
    values, markers = np.array(inputs[..., 0]), np.array(inputs[..., 1])
    assert values.min() >= 0.0 and values.max() < 1.0
    assert set(np.unique(markers)) <= {0.0, 1.0}
    half = length // 2
    np.testing.assert_array_equal(markers[:, :half].sum(axis=1), 1)
    np.testing.assert_array_equal(markers[:, half:].sum(axis=1), 1)
    np.testing.assert_allclose(np.array(targets), (values * markers).sum(axis=1), rtol=1e-6)


def test_adding_problem_is_seeded_and_a_generator_draws_fresh_batches():
    first, _ = data.adding_problem(8, 20, 3)
    again, _ = data.adding_problem(8, 20, 3)
    assert mx.array_equal(first, again)
    rng = np.random.default_rng(3)
    one, _ = data.adding_problem(8, 20, rng)
    two, _ = data.adding_problem(8, 20, rng)
    assert mx.array_equal(one, first) and not mx.array_equal(one, two)


def test_adding_problem_baseline_is_the_variance_of_the_target():
    _, targets = data.adding_problem(200_000, 10, 0)
    mse_of_predicting_one = float(np.mean((np.array(targets) - 1.0) ** 2))
    assert mse_of_predicting_one == pytest.approx(data.ADDING_PROBLEM_BASELINE_MSE, rel=0.01)


@pytest.mark.parametrize(
    ("num_sequences", "length", "match"),
    [(0, 10, "num_sequences"), (4, 1, "length: expected at least 2"), (4, 2.5, "length"), (True, 10, "num_sequences")],
)
def test_adding_problem_rejects_bad_sizes(num_sequences, length, match):
    with pytest.raises(ValueError, match=match):
        data.adding_problem(num_sequences, length)


def test_source_words_are_maximal_ascii_identifier_runs():
    text = "def f(x_1):\n    return 3abc + _private  # Hello, wörld: a.b\n"
    assert data.source_words(text) == ["def", "f", "x_1", "return", "abc", "_private", "Hello", "w", "rld", "a", "b"]
    assert data.source_words("42 + 7.5") == []


def test_python_source_tokens_are_the_words_of_the_stdlib_files_in_name_order():
    files = data.stdlib_source_files()
    assert len(files) > 50 and files == sorted(files)
    assert all(path.suffix == ".py" and path.parent == files[0].parent for path in files)
    tokens = data.python_source_tokens(max_files=3)
    expected = [word for path in files[:3] for word in data.source_words(path.read_text(encoding="utf-8"))]
    assert tokens == expected and len(tokens) > 100
    everything = data.python_source_tokens()
    assert everything[: len(tokens)] == tokens and len(everything) > 100_000
    assert {"def", "return", "self", "True", "None"} <= set(everything)


def test_python_source_tokens_rejects_a_bad_max_files():
    with pytest.raises(ValueError, match="max_files"):
        data.python_source_tokens(max_files=0)
