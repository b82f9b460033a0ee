"""The benchmark harness runs end to end (small sizes) and validates before it times."""

import platform
import re
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
                     "GFLOP of matmuls", "summary", "[ok]", "this machine's limits", "x limit",
                     "training step, character model", "seqlib (compiled)", "compiled / torch",
                     "the step's parts", "embedding + LSTM layers forward+backward (seqlib)", "Adam update (seqlib)",
                     "cross-entropy forward+backward (seqlib)", "compiled with MLX's cross-entropy / torch",
                     "MLX buffer cache limit raised", "streaming with 8-bit weights", "8-bit / float"):  # fmt: skip
        assert expected in result.stdout
    if platform.libc_ver()[0] == "glibc":  # torch's tensors, too, are reused rather than page-faulted anew
        assert "glibc malloc keeps freed memory" in result.stdout
    assert "MISMATCH" not in result.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS routing only exists on Linux")
def test_blas_suite_compares_mlx_with_numpy_and_torch_with_the_routing_on_and_off():
    result = subprocess.run([sys.executable, "-m", "seqlib.bench", "blas", "--quick", "--repeats", "3"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for expected in ("MLX / NumPy =", "(routed)", "matmul", "nn.GRU", "routed / plain ="):
        assert expected in result.stdout


def test_an_implementation_that_disagrees_is_never_timed():
    case = Case("disagreement", {"right": lambda: 1.0, "wrong": lambda: 2.0}, check=lambda a, b: abs(a - b))
    with pytest.raises(AssertionError, match="wrong disagrees with right"):
        run_cases([case], repeats=1, warmup=0)


def test_kernel_suite_says_plainly_when_metal_is_missing():
    result = subprocess.run([sys.executable, "-m", "seqlib.bench", "kernels", "--quick"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Metal is not available on this machine" in result.stdout


@pytest.mark.metal_emulation
def test_kernel_suite_validates_every_kernel_against_the_ops_path_before_timing(capsys):
    from seqlib.bench import kernel_suite

    kernel_suite.main(quick=True, emulate=True)
    printed = capsys.readouterr().out
    for expected in ("LSTM gate math", "LSTM layer forward", "metal v1 (simple)", "metal v2 (simd)",
                     "EmbeddingBag sum forward", "vs ops path", "napkin", "[ok]"):  # fmt: skip
        assert expected in printed
    assert "MISMATCH" not in printed


def test_the_ratio_column_fits_a_long_baseline_name(capsys):
    case = Case("long names", {"one packed product": lambda: 1.0, "four separate products": lambda: 1.0},
                check=lambda a, b: abs(a - b), mlx_baseline="four separate products")  # fmt: skip
    run_cases([case], repeats=1, warmup=0)
    header = next(line for line in capsys.readouterr().out.splitlines() if "implementation" in line)
    assert "vs torch  vs four separate products" in header
    assert header.split() == ["implementation", "median", "ms", "vs", "torch", "vs", "four", "separate", "products",
                              "GB/s", "GFLOP/s"]  # fmt: skip


def test_the_scaling_table_times_mlx_nn_only_up_to_its_cap_and_says_so(capsys, monkeypatch):
    from seqlib.bench import recurrent_suite

    monkeypatch.setattr(recurrent_suite, "SCALING_MLX_NN_STEPS", 6)
    rows = recurrent_suite.print_scaling((4, 6, 12), batches=(1,), repeats=1)
    printed = capsys.readouterr().out
    assert {row["implementation"] for row in rows if row["case"].startswith("LSTM forward, T=12")} >= {"seqlib"}
    assert not any(row["implementation"] == "mlx.nn" and ", T=12 " in row["case"] for row in rows)
    assert "mlx.nn only up to T=6" in printed
    mlx_nn_line = next(line for line in printed.splitlines() if re.match(r"\s+mlx\.nn\s+\d", line))  # its times
    assert mlx_nn_line.split()[3] == "-" and mlx_nn_line.rstrip().endswith("(T=4-6)")
    ratio_line = next(line for line in printed.splitlines() if "seqlib / mlx.nn" in line)
    assert ratio_line.split()[-1] == "-"


def test_every_kernel_has_napkin_math_and_the_cases_agree_with_it():
    from seqlib import kernels
    from seqlib.bench import kernel_suite

    assert set(kernel_suite.NAPKIN) == set(kernels.kernel_names())
    cell = kernel_suite.napkin("lstm_cell", batch=32, hidden_size=512)
    assert cell.bytes_moved == kernel_suite.lstm_cell_case(32, 512, backend="ops").bytes_moved
    assert cell.flops == 30 * 32 * 512
    gather = kernel_suite.napkin("embedding_gather", lookups=10, embedding_dim=8)
    assert (gather.flops, gather.bytes_moved) == (0, 4 * (2 * 10 * 8 + 10))
    sequence = kernel_suite.napkin("lstm_sequence", steps=1, batch=1, hidden_size=1024)
    assert 0.45 < sequence.intensity < 0.55  # 8 H^2 FLOPs for 16 H^2 bytes of W_hh
    assert sequence.seconds(100e9) == sequence.bytes_moved / 100e9
    assert sequence.seconds(100e9, 1.0) == sequence.flops  # a slow enough chip is compute-bound
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernel_suite.napkin("no_such_kernel")


@pytest.mark.metal_emulation
def test_the_quick_cases_agree_with_the_ops_path_without_timing():
    from seqlib.bench import kernel_suite

    for case in kernel_suite.quick_cases("emulate"):
        errors = kernel_suite.max_errors(case)
        assert errors and max(errors.values()) <= case.tolerance, (case.name, errors)


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="x86 flags of /proc/cpuinfo")
def test_benchmarks_name_the_cpu_and_its_vector_extensions():
    from seqlib.bench import cpu_vector_extensions

    described = cpu_vector_extensions()
    model, _, extensions = described.partition("; vector extensions: ")
    assert model and "sse4_2" in extensions.split(), described


def test_the_limit_columns_divide_by_the_machines_roofline(capsys):
    """Given a machine, each case gets the roofline's time on it (the longer of FLOPs over the matmul rate and
    bytes over the bandwidth) and every median over that time, as columns of its table."""
    import time

    from seqlib.bench.machine import Machine

    machine = Machine(sgemm_flops=1e9, bandwidth=1e9, sgemm_size=1, copy_bytes=1, threads=1)
    case = Case("limits", {"sleeper": lambda: time.sleep(0.002) or 1.0}, flops=4e6, bytes_moved=1e6)
    row = run_cases([case], repeats=1, warmup=0, machine=machine)[0]
    assert row["limit_ms"] == pytest.approx(4.0)  # 4e6 FLOP at 1 GFLOP/s, above 1e6 bytes at 1 GB/s
    assert row["vs_limit"] == pytest.approx(row["median_ms"] / 4.0)
    header = next(line for line in capsys.readouterr().out.splitlines() if "implementation" in line)
    assert header.split()[-4:] == ["limit", "ms", "x", "limit"]
    assert machine.limit_seconds(flops=1e6, bytes_moved=3e6) == pytest.approx(3e-3)  # bandwidth-bound


def test_a_measured_machines_matmul_is_timed_with_every_repeat_and_sets_the_cases_limit():
    """A measured machine's product runs once per repeat, interleaved with the case, and the case's limit takes the
    rate of its fastest run (the machine as it was while the case ran), not the rate measured at the start."""
    import time

    from seqlib.bench.machine import Machine

    calls = []

    def matmul():  # a 1000^3 product (2 GFLOP) that takes 4 ms: 500 GFLOP/s
        calls.append(1)
        time.sleep(0.004)

    machine = Machine(sgemm_flops=1e9, bandwidth=1e12, sgemm_size=1000, copy_bytes=1, threads=1, matmul=matmul)
    case = Case("probed", {"sleeper": lambda: time.sleep(0.001) or 1.0}, flops=5e9, bytes_moved=1.0)
    row = run_cases([case], repeats=3, warmup=1, show=False, machine=machine)[0]
    assert len(calls) == 3
    assert 2e9 / 0.006 < row["sgemm_GFLOP/s"] * 1e9 <= 2e9 / 0.004  # sleep overshoots by a little
    assert row["limit_ms"] == pytest.approx(5e9 / (row["sgemm_GFLOP/s"] * 1e9) * 1e3)  # not 5,000 ms at 1 GFLOP/s
    assert machine.sgemm_flops == 1e9  # the machine itself is unchanged


def test_the_training_steps_parts_are_differences_of_its_variants_and_their_losses_match_torch():
    from seqlib.bench import recurrent_suite

    names = [name for name, _, _ in recurrent_suite.TRAINING_VARIANTS]
    medians = {f"seqlib (compiled): {name}": time for name, time in zip(names, (20.0, 15.0, 13.5, 12.5), strict=True)}
    parts = recurrent_suite._training_parts(medians, "seqlib (compiled)")
    assert list(parts) == list(recurrent_suite.TRAINING_PARTS)
    assert list(parts.values()) == [5.0, 1.5, 1.0, 12.5]  # three differences, then the last variant's time
    assert sum(parts.values()) == medians[f"seqlib (compiled): {names[0]}"]
    case = recurrent_suite.training_parts_case(8)
    assert len(case.implementations) == 2 * len(names)
    recurrent_suite.check_training_variants(case)  # seqlib's first loss of every variant against torch's
    case.implementations[f"torch: {names[1]}"] = lambda: 1.0  # a variant whose loss disagrees
    with pytest.raises(AssertionError, match="disagrees"):
        recurrent_suite.check_training_variants(case)
