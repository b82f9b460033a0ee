"""The robustness suite's child-process harness reports returns, errors, crashes and hangs."""

import os
import signal
import time

import mlx.core as mx
import numpy as np
import pytest
from isolated import assert_clear_error, run_isolated


def returns_an_array(n):
    return {"ones": mx.ones((n,)), "n": n}


def raises_mlx_internal():
    return mx.take(mx.zeros((2, 3)), mx.array([0]), axis=5)


def raises_value_error():
    raise ValueError("offsets: expected a 1-D array, got shape (2, 2)")


def segfaults():
    os.kill(os.getpid(), signal.SIGSEGV)


def hangs():
    time.sleep(60)


def test_a_return_comes_back_as_numpy():
    outcome = run_isolated(returns_an_array, 3)
    assert outcome.kind == "returned"
    np.testing.assert_array_equal(outcome.value["ones"], np.ones(3, np.float32))
    assert outcome.value["n"] == 3


def test_a_segfault_fails_the_case_and_the_next_case_still_runs():
    outcome = run_isolated(segfaults)
    assert outcome.kind == "crashed" and "SIGSEGV" in outcome.signal
    with pytest.raises(AssertionError, match="crashed"):
        assert_clear_error(outcome)
    assert run_isolated(returns_an_array, 1).kind == "returned"


def test_a_hang_is_reported_as_a_crash():
    outcome = run_isolated(hangs, timeout_s=1)
    assert outcome.kind == "crashed" and "no answer" in outcome.signal


def test_clear_errors_pass_and_mlx_internal_messages_fail():
    assert_clear_error(run_isolated(raises_value_error), "offsets", "(2, 2)")
    with pytest.raises(AssertionError, match="should name"):
        assert_clear_error(run_isolated(raises_value_error), "per_sample_weights")
    with pytest.raises(AssertionError, match="MLX's internal message"):
        assert_clear_error(run_isolated(raises_mlx_internal))
    with pytest.raises(AssertionError, match="expected a clear error"):
        assert_clear_error(run_isolated(returns_an_array, 2))
