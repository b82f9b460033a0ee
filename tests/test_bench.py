"""The benchmark harness runs end to end (small sizes) and validates before it times."""

import subprocess
import sys

import pytest

from seqlib.bench import Case, run_cases


def test_embedding_suite_runs_and_prints_ratios_and_memory():
    result = subprocess.run([sys.executable, "-m", "seqlib.bench", "embedding", "--quick"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in ("Embedding forward", "EmbeddingBag mean forward", "sparse gradient", "vs torch",
                     "Peak memory", "[ok]"):  # fmt: skip
        assert expected in result.stdout
    assert "MISMATCH" not in result.stdout


def test_recurrent_suite_runs_validates_and_prints_ratios_against_torch_and_mlx_nn():
    result = subprocess.run([sys.executable, "-m", "seqlib.bench", "recurrent", "--quick"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in ("LSTM forward,", "LSTM forward + backward", "GRU forward,", "vs mlx.nn", "torch (1 thread)",
                     "GFLOP of matmuls", "summary", "[ok]"):  # fmt: skip
        assert expected in result.stdout
    assert "MISMATCH" not in result.stdout


def test_an_implementation_that_disagrees_is_never_timed():
    case = Case("disagreement", {"right": lambda: 1.0, "wrong": lambda: 2.0}, check=lambda a, b: abs(a - b))
    with pytest.raises(AssertionError, match="wrong disagrees with right"):
        run_cases([case], repeats=1, warmup=0)
