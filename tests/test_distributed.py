"""seqlib.distributed: averaging dense and sparse gradients across ranks (mx.distributed).

One process: the call is a checked no-op.  Two processes: tests/distributed/train_shards.py runs
under ``mlx.launch --backend ring -n 2`` on localhost; every rank trains on half of each batch and
the result must match one process trained on the whole batches (run here, from the same code).
"""

import importlib.util
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import seqlib
from seqlib.distributed import average_gradients, launch_local

SCRIPT = Path(__file__).parent / "distributed" / "train_shards.py"

# Tolerances against one process on the whole batch.  The ranks' gradient is the mean of two shard
# sums instead of one sum over the batch: the same numbers added in another order, so it differs by
# float32 rounding (about 1e-7 relative; the first step's embedding gradient is checked directly).
# SGD's step is linear in the gradient: the parameters differ by about lr times that (measured: 3e-8
# after 3 steps, the table's entries of size 3.6 included, whose ulp is 2.4e-7).  Adam divides each
# element by its own running size, which amplifies the rounding of small gradient elements (measured:
# 3e-7).  A wrong average (a sum instead of a mean, a lost, doubled or padded row) moves parameters by
# 1e-3 and more.
ATOL = {"adam": 1e-5, "sgd": 2e-6}


def load_script():
    spec = importlib.util.spec_from_file_location("train_shards", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- one process ---------------------------------------------------------------------------------------


def sparse_gradient():
    return seqlib.SparseGradient(mx.array([1, 3]), mx.ones((2, 2)), (5, 2))


def test_one_process_returns_the_same_tree():
    assert mx.distributed.init().size() == 1  # not under mlx.launch
    tree = {"a": mx.ones((2, 3)), "b": [sparse_gradient(), (mx.zeros(4),)]}
    assert average_gradients(tree) is tree
    assert average_gradients(tree, mx.distributed.init()) is tree
    leaf = sparse_gradient()
    assert average_gradients(leaf) is leaf
    assert average_gradients({}) == {}


@pytest.mark.parametrize("group", ["ring", 1, [], mx.ones(1)])
def test_a_group_of_the_wrong_type_is_refused(group):
    with pytest.raises(TypeError, match=r"group: expected an mlx\.core\.distributed\.Group or None, got"):
        average_gradients({"a": mx.ones(2)}, group)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"a": 1.0}, r"grads\['a'\]: expected an mlx.core.array or a seqlib.sparse.SparseGradient .*got float"),
        ({"a": [mx.ones(2), None]}, r"grads\['a.1'\]: expected .* got NoneType"),
        ({"a": np.ones(2, np.float32)}, r"grads\['a'\]: expected .* got ndarray"),
        ("weights", r"grads: expected .* got str"),
        ({"a": {"b": mx.array([1, 2])}}, r"grads\['a.b'\]: expected a floating gradient, got an array of dtype"),
    ],
)
def test_leaves_that_are_not_gradients_are_refused(tree, message):
    with pytest.raises(TypeError, match=message):
        average_gradients(tree)


# ---- two processes ------------------------------------------------------------------------------------


def run_two_ranks(tmp_path, **environment) -> tuple[object, str]:
    """Launch train_shards.py as two ranks writing into tmp_path; the result and a report of its output."""
    environment = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **environment}  # 2 cores
    try:
        result = launch_local(SCRIPT, tmp_path, ranks=2, env=environment)
    except FileNotFoundError as error:  # no mlx.launch
        pytest.skip(str(error))
    return result, f"mlx.launch exited with {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_two_ranks_train_exactly_like_one_process_on_the_combined_batch(tmp_path):
    result, output = run_two_ranks(tmp_path)
    script = load_script()
    for config in script.CONFIGS:
        paths = [tmp_path / f"{config}_rank{rank}.npz" for rank in (0, 1)]
        missing = [path.name for path in paths if not path.exists()]
        assert not missing, f"ranks did not report {missing} (the launcher may exit 0 when a rank fails)\n{output}"
        rank0, rank1 = (dict(np.load(path)) for path in paths)
        reference = script.train(config)  # one process, the whole batches

        counts = rank0["check_rows_differ"]
        assert counts[0] != counts[1], "the ranks should touch different numbers of rows"
        assert rank0["check_coalesced"] and rank1["check_coalesced"]
        assert rank0["check_sparse_vs_dense_mean"] < 1e-6
        assert rank0["check_structure_kept"] and rank1["check_structure_kept"]
        assert rank0["check_mismatch_refused"] and rank1["check_mismatch_refused"]

        np.testing.assert_array_equal(rank0["first_rows"], reference["first_rows"])  # the same rows, once each
        np.testing.assert_allclose(rank0["first_values"], reference["first_values"], rtol=1e-5, atol=1e-7,
                                   err_msg=f"{config}: the averaged embedding gradient")  # fmt: skip
        for name, value in reference.items():
            if name.startswith("first_"):
                continue
            np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=f"{config} {name}: ranks drifted")
            np.testing.assert_allclose(rank0[name], value, rtol=0, atol=ATOL[config],
                                       err_msg=f"{config} {name}: 2 ranks vs one process")  # fmt: skip
    assert "rank 0 of 2: done" in result.stdout and "rank 1 of 2: done" in result.stdout, output


def test_summing_instead_of_averaging_is_caught_at_the_gradient_and_by_sgd(tmp_path):
    # Adam divides every step by the running size of the gradient, so a gradient twice too large
    # moves Adam's parameters hardly at all: a parameter check with Adam alone can miss this slip.
    # The checks above compare the averaged gradient itself, and train one model with plain SGD.
    _, output = run_two_ranks(tmp_path, SEQLIB_PLANT_SUM="1")
    script = load_script()
    for config in script.CONFIGS:
        rank0 = dict(np.load(tmp_path / f"{config}_rank0.npz"))
        reference = script.train(config)
        ratio = np.abs(rank0["first_values"]).sum() / np.abs(reference["first_values"]).sum()
        assert ratio == pytest.approx(2.0, rel=1e-5), f"{config}: the planted sum should double the gradient"
        with pytest.raises(AssertionError):  # what the test above asserts on the gradient
            np.testing.assert_allclose(rank0["first_values"], reference["first_values"], rtol=1e-5, atol=1e-7)
    sgd = dict(np.load(tmp_path / "sgd_rank0.npz"))
    sgd_reference = script.train("sgd")
    parameters = [name for name in sgd_reference if not name.startswith("first_")]
    worst = max(np.abs(sgd[name] - sgd_reference[name]).max() for name in parameters)
    assert worst > 100 * ATOL["sgd"], f"SGD's parameters should show the doubled step, moved only {worst}\n{output}"


# ---- launch_local --------------------------------------------------------------------------------------

FLAKY = Path(__file__).parent / "distributed" / "flaky_rank.py"


def test_launch_local_runs_every_rank_of_one_ring(tmp_path):
    result = launch_local(FLAKY, tmp_path, "once", ranks=2, attempts=2)  # rank 1 fails once, then succeeds
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 of 2: all_sum -> 3.0", "rank 1 of 2: all_sum -> 3.0"], result.stdout


def test_launch_local_reports_every_failed_attempt(tmp_path):
    with pytest.raises(RuntimeError, match=r"the 2-rank job failed \(2 attempts\)") as caught:
        launch_local(FLAKY, tmp_path, "always", attempts=2)
    failures = [line for line in str(caught.value).splitlines() if line.startswith("attempt ")]
    assert [line.split(":")[0] for line in failures] == ["attempt 1", "attempt 2"], failures
    for line in failures:  # rank 0 may fail too, on the broken ring, reported before or after rank 1
        assert "Node with rank 1 exited with code 3" in line, line
        assert line.count("Node with rank 1 ") == 1, line


def test_launch_local_kills_a_job_that_runs_past_its_timeout(tmp_path):
    with pytest.raises(RuntimeError, match=r"attempt 1: ran past 10(\.0)? s"):
        launch_local(FLAKY, tmp_path, "hang", timeout=10, attempts=1)
    pids = {path.name: int(path.read_text()) for path in tmp_path.glob("hanging_*")}
    assert sorted(pids) == ["hanging_0", "hanging_1"]  # both ranks joined the ring, then hung
    deadline = time.monotonic() + 5
    while any(map(running, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids.values())), f"ranks still running after the timeout: {pids}"


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one killed, not yet reaped, is dead too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")  # Linux: the state letter follows the command's closing parenthesis
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"ranks": 0}, ValueError, r"ranks: expected a positive int, got 0"),
        ({"ranks": True}, ValueError, r"ranks: expected a positive int, got True"),
        ({"attempts": 0}, ValueError, r"attempts: expected a positive int, got 0"),
        ({"script": "no/such/script.py"}, FileNotFoundError, r"script: no such file 'no/such/script.py'"),
    ],
)
def test_launch_local_refuses_bad_arguments(arguments, error, message):
    script = arguments.pop("script", FLAKY)
    with pytest.raises(error, match=message):
        launch_local(script, "unused", **arguments)
