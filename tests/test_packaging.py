"""seqlib as a package: public API, optional dependencies, and a real wheel install."""

import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import seqlib

ROOT = Path(__file__).resolve().parents[1]

# Run in the scratch venv: lstm_cell.metal through the installed seqlib.emulation, against NumPy.
EMULATED_LSTM_CELL = """
import sys
sys.path.append(sys.argv[1])
import numpy as np
import seqlib
import mlx.core as mx
from seqlib import emulation, kernels

batch, hidden = 3, 70
rng = np.random.default_rng(0)
gates = rng.normal(size=(batch, 4 * hidden)).astype(np.float32)
c_prev = rng.normal(size=(batch, hidden)).astype(np.float32)
kernel = emulation.metal_kernel(
    name="lstm_cell", input_names=["gates", "c_prev"], output_names=["h", "c", "activations", "tanh_c"],
    source=kernels.kernel_source("lstm_cell"), header=kernels.kernel_header())
h, c, activations, tanh_c = kernel(
    inputs=[mx.array(gates), mx.array(c_prev)], template=[("T", mx.float32)],
    output_shapes=[(batch, hidden), (batch, hidden), (batch, 4 * hidden), (batch, hidden)],
    output_dtypes=[mx.float32] * 4, grid=(hidden, batch, 1), threadgroup=(64, 4, 1))

sigmoid = lambda x: 1 / (1 + np.exp(-x.astype(np.float64)))
i, f, g, o = np.split(gates, 4, axis=1)
c_expected = sigmoid(f) * c_prev + sigmoid(i) * np.tanh(g)
h_expected = sigmoid(o) * np.tanh(c_expected)
print(emulation.compiler.HEADER)
print(np.abs(np.array(h) - h_expected).max(), np.abs(np.array(c) - c_expected).max())

# The same step through the library: the ops path, and the kernel path on the emulated backend.
with kernels.use_backend("ops"):
    ops = seqlib.pointwise.lstm_pointwise(mx.array(gates), mx.array(c_prev))
with kernels.use_backend("emulate"):
    emulated = seqlib.pointwise.lstm_pointwise(mx.array(gates), mx.array(c_prev))
print(max(float(np.abs(np.array(a) - np.array(b)).max()) for a, b in zip(ops, emulated)))
"""


def test_version_and_public_api():
    assert seqlib.__version__.count(".") == 2
    for name in seqlib.__all__:
        assert getattr(seqlib, name) is not None, name
    for module_name in ("seqlib.nn", "seqlib.functional", "seqlib.kernels", "seqlib.emulation"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.{name}"
    assert (Path(seqlib.__file__).parent / "py.typed").exists()


def test_import_loads_no_optional_dependency():
    code = "import sys, seqlib; print(sorted(m for m in ('torch', 'matplotlib', 'ipywidgets') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_wheel_installs_and_finds_its_kernel_sources(tmp_path):
    """Build a wheel, install it into a scratch venv, load a .metal source from the install and run it
    through the installed emulation."""
    # setuptools copies modules into build/lib and never deletes one: a module since removed from the
    # sources would still ship, so the build starts from an empty build folder.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("seqlib-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True)

    # Dependencies (mlx, numpy) come from this test's environment, after the scratch venv's own packages.
    deps = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys; sys.path.append({deps!r}); import seqlib; "
        "print(seqlib.__file__); print(seqlib.kernels.kernel_dir()); "
        "print(len(seqlib.kernels.kernel_source('embedding_gather'))); "
        "print(','.join(seqlib.kernels.kernel_names())); print(len(seqlib.kernels.kernel_header())); "
        "import pkgutil; print(','.join(sorted(m.name for m in pkgutil.walk_packages(seqlib.__path__, 'seqlib.')))); "
        "import seqlib.native as n; print(all(p.is_file() for p in (*n.SOURCES, n.HEADER)))"
    )
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    module_file, kernel_dir, length, installed_kernels, header_length, installed_modules, native_sources = (
        result.stdout.split()
    )
    assert native_sources == "True"  # seqlib.native's C++ sources and header, for the build on first use
    assert module_file.startswith(str(env_dir))
    source_modules = sorted(m.name for m in pkgutil.walk_packages(seqlib.__path__, "seqlib."))
    assert installed_modules.split(",") == source_modules  # every subpackage made it into the wheel
    assert kernel_dir == str(Path(module_file).parent / "metal_kernels")
    assert int(length) > 100
    assert installed_kernels.split(",") == seqlib.kernels.kernel_names()  # every kernel and the shared header
    assert int(header_length) > 100

    if sys.platform == "linux":  # the C++ primitives and the BLAS shim were built with the wheel: no compiler needed
        no_compiler = {key: value for key, value in os.environ.items() if key not in ("CC", "CXX")}
        no_compiler.update(PATH="/nonexistent", SEQLIB_CACHE_DIR=str(tmp_path / "empty-cache"))
        prebuilt = subprocess.run(
            [python, "-c", f"import sys; sys.path.append({deps!r}); import seqlib, mlx.core as mx; "
             "from seqlib import native; print(seqlib.route_mlx_blas().routed, native.available(), "
             "native.module().__file__); layer = seqlib.nn.GRU(3, 4); mx.eval(layer(mx.ones((2, 1, 3)))[0])"],
            capture_output=True, text=True, cwd=tmp_path, env=no_compiler,
        )  # fmt: skip
        assert prebuilt.returncode == 0, prebuilt.stderr[-3000:]
        routed, available, native_file = prebuilt.stdout.split()
        assert routed == "True" and available == "True" and native_file.startswith(str(env_dir)), prebuilt.stdout
        assert not (tmp_path / "empty-cache").exists() or not any((tmp_path / "empty-cache").iterdir())

    # The emulation ships with its C++ header and runs a kernel from the install (compiled afresh there).
    emulated = subprocess.run(
        [python, "-c", EMULATED_LSTM_CELL, deps], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "SEQLIB_EMULATION_CACHE": str(tmp_path / "emulation-cache")},
    )  # fmt: skip
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    header_path, h_error, c_error, ops_difference = emulated.stdout.split()
    assert header_path == str(Path(module_file).parent / "emulation" / "include" / "metal_emulation.h")
    assert Path(header_path).is_file()
    assert float(h_error) < 1e-6 and float(c_error) < 1e-6
    assert float(ops_difference) < 1e-6  # the installed kernel path matches the installed ops path
