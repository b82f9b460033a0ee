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
    seqlib.route_mlx_blas()

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
        seqlib.route_mlx_blas()
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
                         "seqlib_blas_shim_last_threads", "seqlib_blas_shim_threaded_calls"}


MLX_FIRST = """
    import ctypes, json
    import mlx.core as mx
    a = mx.random.normal((96, 80)); b = mx.random.normal((80, 72))
    mx.eval(a @ b)  # libmlx.so's cblas_sgemm is bound (to the reference BLAS) and has been called
    import seqlib
    seqlib.route_mlx_blas()
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
    result = run_python("import seqlib; seqlib.route_mlx_blas(); print(seqlib.blas_status().reason)", SEQLIB_BLAS="0")
    assert result.returncode == 0 and result.stderr == ""
    assert "SEQLIB_BLAS=0" in result.stdout


@linux_only
@pytest.mark.parametrize("coretype", [None, "Haswell", "Sandybridge"])
def test_the_status_names_the_openblas_kernels_that_run(coretype):
    """blas_status().kernels is the loaded OpenBLAS's own name for its kernels, so that a benchmark can say which
    ran; where OPENBLAS_CORETYPE chooses them (as on machines whose older OpenBLAS builds misjudge the CPU), the
    chosen ones.  The name is what the same library says when loaded on its own in a fresh process."""
    probe = """
        import ctypes, os, scipy_openblas32
        lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
        lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
        print(lib.scipy_openblas_get_corename().decode())
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env |= {"OPENBLAS_CORETYPE": coretype} if coretype else {}
    codes = (probe, "import seqlib; print(seqlib.route_mlx_blas().kernels)")
    alone, routed = (subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                                    text=True, timeout=300) for code in codes)
    assert alone.returncode == 0 and routed.returncode == 0, alone.stderr + routed.stderr
    assert routed.stdout.strip() == alone.stdout.strip() and routed.stdout.strip()
    if coretype is not None:
        assert routed.stdout.strip().lower() == coretype.lower()


IMPORT_ALONE = """
    import ctypes, json, os
    import mlx.core as mx
    a = mx.random.normal((96, 80), key=mx.random.key(0)); b = mx.random.normal((80, 72), key=mx.random.key(1))
    before = (a @ b).tolist()
    import seqlib
    from seqlib import _blas

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    libdl = ctypes.CDLL(None)
    libdl.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]

    def slot_owners():  # which library each of libmlx.so's cblas_*gemm slots points into
        path, bias = _blas._loaded_mlx_library()
        owners = set()
        for offsets in _blas._gemm_slots(path)[0].values():
            for offset in offsets:
                info = DlInfo()
                libdl.dladdr(ctypes.c_void_p.from_address(bias + offset).value, ctypes.byref(info))
                owners.add(os.path.basename(info.fname.decode()))
        return sorted(owners)

    imported = {"owners": slot_owners(), "same_product": (a @ b).tolist() == before,
                "cache": sorted(os.listdir(os.environ["SEQLIB_CACHE_DIR"])), "routed": seqlib.blas_status().routed}
    seqlib.route_mlx_blas()
    print(json.dumps({"imported": imported, "routed_owners": slot_owners()}))
"""


@linux_only
def test_import_builds_nothing_and_leaves_mlx_alone_until_asked(tmp_path):
    """``import seqlib`` compiles nothing and rebinds nothing; ``seqlib.route_mlx_blas()`` rebinds."""
    result = run_python(IMPORT_ALONE, SEQLIB_CACHE_DIR=str(tmp_path), SEQLIB_BLAS="")
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    imported = outcome["imported"]
    assert imported["cache"] == [] and not imported["routed"] and imported["same_product"]
    assert imported["owners"] and not any("blas_shim" in owner for owner in imported["owners"])
    assert all("blas_shim" in owner for owner in outcome["routed_owners"])


SPIN_PROBE = """
    import os, time, mlx.core as mx, seqlib
    seqlib.route_mlx_blas()
    a = mx.ones((1024, 1024))
    mx.eval(a @ a)  # OpenBLAS's workers start
    burnt = []
    for _ in range(3):
        mx.eval(a @ a)
        start = time.process_time()
        time.sleep(0.3)  # this thread sleeps: what the process burns meanwhile is the workers' spinning
        burnt.append(time.process_time() - start)
    print(min(burnt), "OPENBLAS_THREAD_TIMEOUT" in os.environ)
"""


@linux_only
@pytest.mark.parametrize("timeout, spins", [(None, False), ("28", True)])
def test_openblas_workers_stop_spinning_soon_after_a_product_unless_the_user_says_otherwise(timeout, spins):
    """seqlib's time loops start right after MLX's input product and need both cores; OpenBLAS's default
    spin (2^28 cycles, about 0.1 s of a core after every threaded call) took one.  The shim's OpenBLAS is
    loaded with 2^14 (seqlib._blas.OPENBLAS_WORKER_SPIN), the environment left as it was; a value the user
    set is kept."""
    if spins and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenBLAS has no worker thread on one core")
    env = {"OPENBLAS_NUM_THREADS": "2"} | ({"OPENBLAS_THREAD_TIMEOUT": timeout} if timeout else {})
    if timeout is None:
        env_without = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(SPIN_PROBE)], env=env_without | env,
                                capture_output=True, text=True, timeout=300)  # fmt: skip
    else:
        result = run_python(SPIN_PROBE, **env)
    assert result.returncode == 0, result.stderr
    burnt, still_set = result.stdout.split()
    assert still_set == ("True" if timeout else "False")
    if spins:
        assert float(burnt) > 0.03  # the user's 2^28 cycles: tens of milliseconds
    else:
        assert float(burnt) < 0.02  # 2^14 cycles: microseconds


@linux_only
def test_small_products_run_on_one_openblas_thread_and_large_ones_on_all_it_may_use():
    """A recurrent step's small GEMM handed to several threads waited on them: 10x slower on a busy machine.
    The shim lowers the thread count for such calls and restores it; it never raises it (threadpoolctl).
    It counts the calls that run threaded (seqlib.native's idle workers stop watching at one)."""
    result = run_python("""
        import ctypes, os, scipy_openblas32, seqlib, mlx.core as mx
        seqlib.route_mlx_blas()
        openblas = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
        shim = ctypes.CDLL(seqlib.blas_status().shim_path)
        last, threaded = shim.seqlib_blas_shim_last_threads, shim.seqlib_blas_shim_threaded_calls
        threaded.restype = ctypes.c_int64
        used, after, counted = [], [], []
        for limit, size in ((2, 8), (2, 512), (2, 16), (1, 512)):  # 512, 134 million, 4,096 multiply-adds
            openblas.scipy_openblas_set_num_threads(limit)  # as threadpoolctl would
            a = mx.ones((size, size))
            mx.eval(a)
            before = threaded()
            mx.eval(a @ a)
            used.append(last())
            after.append(openblas.scipy_openblas_get_num_threads())
            counted.append(threaded() - before)
        print(used, after, counted)
    """, OPENBLAS_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1, 2, 1, 1] [2, 2, 2, 1] [0, 1, 0, 0]"


@linux_only
def test_openblas_workers_may_run_on_every_cpu_but_the_callers():
    """A woken OpenBLAS worker placed on its caller's CPU shared it for a whole product while another CPU
    idled; the shim keeps the workers off the CPU of the thread that calls a threaded product (and only
    that one), and moves them when the caller moves."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenBLAS has no worker thread on one core")
    result = run_python("""
        import ctypes, json, os, numpy as np, scipy_openblas32, seqlib
        seqlib.route_mlx_blas()
        openblas = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so"))
        shim = ctypes.CDLL(seqlib.blas_status().shim_path)
        libc = ctypes.CDLL(None)
        if not hasattr(openblas, "openblas_getaffinity"):  # an OpenBLAS without it: the shim leaves workers be
            raise SystemExit(print(json.dumps({"skip": "this OpenBLAS has no openblas_getaffinity"})))
        size = 512  # 134 million multiply-adds: a threaded product
        a, c = np.ones((size, size), np.float32), np.zeros((size, size), np.float32)
        pointer = lambda array: array.ctypes.data_as(ctypes.c_void_p)
        shim.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        seen = []
        for cpu in sorted(os.sched_getaffinity(0))[:2]:  # the caller on one CPU, then on another
            os.sched_setaffinity(0, {cpu})
            os.sched_setaffinity(0, set(range(os.cpu_count())))  # free again, but now running on `cpu`
            for attempt in range(20):
                before = libc.sched_getcpu()
                shim.cblas_sgemm(101, 111, 111, size, size, size, 1.0, pointer(a), size, pointer(a), size, 0.0,
                                 pointer(c), size)
                if libc.sched_getcpu() == before:
                    break
            mask = (ctypes.c_ulong * 16)()
            assert openblas.openblas_getaffinity(0, ctypes.sizeof(mask), mask) == 0
            allowed = [i for i in range(os.cpu_count()) if mask[i // 64] >> (i % 64) & 1]
            seen.append((before, allowed))
        assert float(c[0, 0]) == size
        print(json.dumps({"seen": seen, "everywhere": sorted(os.sched_getaffinity(0))}))
    """, OPENBLAS_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report["seen"]) == 2
    for caller, allowed in report["seen"]:
        assert allowed == [cpu for cpu in report["everywhere"] if cpu != caller]


@linux_only
def test_one_row_or_one_column_products_go_to_gemv_with_every_layout():
    """OpenBLAS's GEMM packs its matrix operand on every call: a 1 x 2048 x 512 product cost 5x its GEMV.
    The shim sends m == 1 and n == 1 to GEMV; every transposition and stride must give the product, and
    a fresh output must not leak into it (beta = 0)."""
    result = run_python("""
        import ctypes, json, numpy as np, seqlib, mlx.core as mx
        seqlib.route_mlx_blas()
        calls = ctypes.CDLL(seqlib.blas_status().shim_path).seqlib_blas_shim_calls
        calls.restype = ctypes.c_int64
        rng = np.random.default_rng(0)
        def arr(*shape):
            return rng.standard_normal(shape).astype(np.float32)
        errors = {}
        cases = {
            "row @ matrix": (arr(1, 7), arr(7, 5)),
            "row @ matrix.T": (arr(1, 7), arr(5, 7).T),
            "column.T @ matrix": (arr(7, 1).T, arr(7, 5)),
            "matrix @ column": (arr(5, 7), arr(7, 1)),
            "matrix.T @ column": (arr(7, 5).T, arr(7, 1)),
            "matrix @ row.T": (arr(5, 7), arr(1, 7).T),
            "strided rows": (arr(3, 9)[1:2, ::1], arr(4, 9)[:, :9].T),
            "a column of a wider matrix as the row": (arr(7, 9)[:, 2:3].T, arr(7, 5)),
            "a column of a wider matrix as the column": (arr(5, 7), arr(7, 9)[:, 4:5]),
            "a row of a taller matrix as the column": (arr(5, 7), arr(3, 7)[1:2].T),
            "1 x 1": (arr(1, 6), arr(6, 1)),
        }
        before = calls()
        for name, (a, b) in cases.items():
            for dtype in (mx.float32, mx.float64):
                product = mx.matmul(mx.array(a, dtype=dtype), mx.array(b, dtype=dtype), stream=mx.cpu)
                want = a.astype(np.float64) @ b.astype(np.float64)
                errors[f"{name} {dtype}"] = float(np.abs(np.array(product).astype(np.float64) - want).max())
        bias, (row, matrix) = arr(5), cases["row @ matrix"]
        added = mx.addmm(mx.array(bias), mx.array(row), mx.array(matrix))
        errors["addmm"] = float(np.abs(np.array(added) - (bias + row @ matrix)).max())
        print(json.dumps({"errors": errors, "forwarded": calls() - before}))
    """)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["forwarded"] >= 23  # every product came through the shim
    for name, error in report["errors"].items():
        assert error < 1e-5, (name, error)


@linux_only
def test_the_shims_gemm_gives_the_product_for_every_shape_transposition_and_stride():
    """The shim's cblas_sgemm/dgemm called directly: GEMV for one row or column, GEMM otherwise, with
    padded leading dimensions, alpha, beta, and NaN in an output that beta = 0 must ignore."""
    import ctypes
    import itertools

    import numpy as np

    shim = ctypes.CDLL(seqlib.blas_status().shim_path)
    rng = np.random.default_rng(0)
    for (m, n, k), trans_a, trans_b, beta, dtype in itertools.product(
        [(1, 5, 7), (4, 1, 6), (1, 1, 3), (3, 4, 5)], (False, True), (False, True), (0.0, 0.5), (np.float32, np.float64)
    ):
        pad = 3  # every leading dimension is longer than its row, as for a slice of a wider matrix
        stored_a = rng.standard_normal((k, m + pad) if trans_a else (m, k + pad)).astype(dtype)
        stored_b = rng.standard_normal((n, k + pad) if trans_b else (k, n + pad)).astype(dtype)
        a = stored_a[:, :m].T if trans_a else stored_a[:, :k]
        b = stored_b[:, :k].T if trans_b else stored_b[:, :n]
        c = rng.standard_normal((m, n + pad)).astype(dtype)
        if beta == 0:
            c[:] = np.nan
        want = 1.5 * a.astype(np.float64) @ b.astype(np.float64) + (beta * c[:, :n] if beta else 0)
        scalar, pointer = ctypes.c_float if dtype == np.float32 else ctypes.c_double, ctypes.c_void_p
        gemm = shim.cblas_sgemm if dtype == np.float32 else shim.cblas_dgemm
        gemm.argtypes = [ctypes.c_int] * 6 + [scalar, pointer, ctypes.c_int, pointer, ctypes.c_int, scalar,
                                                  pointer, ctypes.c_int]  # fmt: skip
        gemm(101, 112 if trans_a else 111, 112 if trans_b else 111, m, n, k, 1.5,
             stored_a.ctypes.data, stored_a.shape[1], stored_b.ctypes.data, stored_b.shape[1], beta,
             c.ctypes.data, c.shape[1])  # fmt: skip
        case = f"m={m} n={n} k={k} trans_a={trans_a} trans_b={trans_b} beta={beta} {dtype.__name__}"
        np.testing.assert_allclose(c[:, :n], want, rtol=1e-5, atol=1e-5, err_msg=case)
