"""The Linux BLAS routing in seqlib._blas: fast MLX matmuls, PyTorch untouched."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import seqlib

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the routing only exists on Linux")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (import order matters here) and return the result."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


# Speed is measured in `python -m seqlib.bench blas` (MLX against NumPy, torch with the routing on and off);
# these tests check the mechanism that the speed rests on.

SYMBOL_OWNERS = """
    import ctypes, json
    import seqlib, torch, numpy, mlx.core as mx

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    libdl = ctypes.CDLL(None)
    libdl.dlsym.restype, libdl.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]

    def owner(name):
        address = libdl.dlsym(None, name.encode())  # RTLD_DEFAULT: what a library binding `name` would get
        info = DlInfo()
        return libdl.dladdr(address, ctypes.byref(info)) and info.fname.decode() if address else None

    blas = [prefix + routine for prefix in ("s", "d", "c", "z") for routine in ("gemm", "gemv", "axpy", "dot", "trsm")]
    names = [name + "_" for name in blas] + ["cblas_" + name for name in blas] + ["sgetrf_", "dpotrf_"]
    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    print(json.dumps({"owners": {name: owner(name) for name in names},
                      "torch_threads": torch.get_num_threads(), "routed": seqlib.blas_status().routed}))
"""

ROUTED = {"cblas_sgemm", "cblas_dgemm", "cblas_cgemm"}


@linux_only
def test_the_routing_changes_which_library_serves_the_three_gemms_and_nothing_else():
    """With torch, NumPy and MLX loaded, every other BLAS/LAPACK name resolves as it would without seqlib.

    A global OpenBLAS once captured torch's Fortran ``sgemm_`` and made its GRU 3x slower: that shows here
    as ``sgemm_`` changing owner.
    """
    routed_run, plain_run = (run_python(SYMBOL_OWNERS, SEQLIB_BLAS=setting) for setting in ("1", "0"))
    assert routed_run.returncode == 0, routed_run.stderr
    assert plain_run.returncode == 0, plain_run.stderr
    routed, plain = json.loads(routed_run.stdout), json.loads(plain_run.stdout)
    assert routed["routed"] and not plain["routed"]
    shim = seqlib.blas_status().shim_path
    for name, owner in routed["owners"].items():
        if name in ROUTED:
            assert owner == shim, f"{name} is served by {owner}, not the shim"
        else:
            assert owner == plain["owners"][name], f"{name}: {plain['owners'][name]} without routing, {owner} with"
            assert owner is None or "openblas" not in owner, f"{name} leaked from OpenBLAS ({owner})"
    assert routed["torch_threads"] == plain["torch_threads"]


@linux_only
def test_mlx_matmuls_reach_openblas_through_the_shim():
    result = run_python("""
        import ctypes, seqlib, mlx.core as mx
        calls = ctypes.CDLL(seqlib.blas_status().shim_path).seqlib_blas_shim_calls
        calls.restype = ctypes.c_int64
        before = calls()
        a = mx.random.normal((96, 80)); b = mx.random.normal((80, 72))
        product = a @ b
        mx.eval(product)
        print(calls() - before, float(mx.abs(product - (a[:, :, None] * b[None]).sum(axis=1)).max()))
    """)
    assert result.returncode == 0, result.stderr
    forwarded, error = result.stdout.split()
    assert int(forwarded) >= 1, "MLX's float32 matmul did not go through the shim"
    assert float(error) < 1e-4


@linux_only
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_shim_exports_only_mlxs_three_gemm_names():
    shim_path = seqlib.blas_status().shim_path
    listing = subprocess.run(["nm", "-D", "--defined-only", shim_path], capture_output=True, text=True).stdout
    functions = {line.split()[-1] for line in listing.splitlines() if " T " in line}
    assert functions == {"cblas_sgemm", "cblas_dgemm", "cblas_cgemm", "seqlib_blas_shim_calls",
                         "seqlib_blas_shim_last_threads"}


MLX_FIRST = """
    import ctypes, json
    import mlx.core as mx
    a = mx.random.normal((96, 80)); b = mx.random.normal((80, 72))
    mx.eval(a @ b)  # libmlx.so's cblas_sgemm is bound (to the reference BLAS) and has been called
    import seqlib
    calls = ctypes.CDLL(seqlib.blas_status().shim_path).seqlib_blas_shim_calls
    calls.restype = ctypes.c_int64
    before = calls()
    product = a @ b
    mx.eval(product)
    error = float(mx.abs(product - (a[:, :, None] * b[None]).sum(axis=1)).max())
    print(json.dumps({"routed": seqlib.blas_status().routed, "reason": seqlib.blas_status().reason,
                      "forwarded": calls() - before, "error": error}))
"""


@linux_only
def test_importing_mlx_first_still_routes_its_matmuls_silently():
    """Most MLX code starts with ``import mlx.core as mx``: seqlib rebinds libmlx.so's three slots then."""
    result = run_python(MLX_FIRST)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["routed"] and "rebound" in outcome["reason"]
    assert outcome["forwarded"] >= 1, "MLX's float32 matmul did not go through the shim"
    assert outcome["error"] < 1e-4


@linux_only
def test_rebinding_after_mlx_changes_which_library_serves_the_three_gemms_and_nothing_else():
    mlx_first = SYMBOL_OWNERS.replace("import seqlib, torch, numpy, mlx.core as mx",
                                      "import mlx.core as mx; mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))\n"
                                      "    import torch, numpy, seqlib")  # fmt: skip
    routed_run, plain_run = (run_python(mlx_first, SEQLIB_BLAS=setting) for setting in ("1", "0"))
    assert routed_run.returncode == 0, routed_run.stderr
    routed, plain = json.loads(routed_run.stdout), json.loads(plain_run.stdout)
    assert routed["routed"] and not plain["routed"]
    for name, owner in routed["owners"].items():
        if name not in ROUTED:
            assert owner == plain["owners"][name], f"{name}: {plain['owners'][name]} without routing, {owner} with"
    assert routed["torch_threads"] == plain["torch_threads"]


@linux_only
def test_the_environment_variable_turns_routing_off_silently():
    result = run_python("import seqlib; print(seqlib.blas_status().reason)", SEQLIB_BLAS="0")
    assert result.returncode == 0 and result.stderr == ""
    assert "SEQLIB_BLAS=0" in result.stdout


@linux_only
def test_small_products_run_on_one_openblas_thread_and_large_ones_on_all_it_may_use():
    """A recurrent step's small GEMM handed to several threads waited on them: 10x slower on a busy machine.
    The shim lowers the thread count for such calls and restores it; it never raises it (threadpoolctl)."""
    result = run_python("""
        import ctypes, os, scipy_openblas32, seqlib, mlx.core as mx
        openblas = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
        last = ctypes.CDLL(seqlib.blas_status().shim_path).seqlib_blas_shim_last_threads
        used, after = [], []
        for limit, size in ((2, 8), (2, 512), (2, 16), (1, 512)):  # 512, 134 million, 4,096 multiply-adds
            openblas.scipy_openblas_set_num_threads(limit)  # as threadpoolctl would
            a = mx.ones((size, size))
            mx.eval(a @ a)
            used.append(last())
            after.append(openblas.scipy_openblas_get_num_threads())
        print(used, after)
    """, OPENBLAS_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1, 2, 1, 1] [2, 2, 2, 1]"
