"""Give MLX's CPU backend an optimised BLAS on Linux.

MLX's Linux wheel links netlib's *reference* BLAS: a float32 matmul runs at a
few GFLOP/s there, 20-30x slower than NumPy on the same machine.  MLX calls only
``cblas_sgemm``, ``cblas_dgemm`` and ``cblas_cgemm``, so we build a tiny shim
library (``_blas_shim.c``) that defines exactly those three names and forwards
them to the OpenBLAS shipped by the ``scipy-openblas32`` wheel, load it with
``RTLD_GLOBAL`` and only then import ``mlx.core``.  The dynamic linker then
binds MLX's references to the shim instead of the reference BLAS.

Nothing else is exported, so PyTorch (or NumPy) in the same process keeps its
own BLAS and its speed.  On macOS nothing is done: MLX uses Accelerate.

Set ``SEQLIB_BLAS=0`` to turn the routing off.  If it cannot be done (no C
compiler, no scipy-openblas32, or ``mlx.core`` imported before ``seqlib``) a
one-line :class:`BlasRoutingWarning` says so and MLX keeps its own BLAS.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "SEQLIB_BLAS"
SHIM_SOURCE = Path(__file__).with_name("_blas_shim.c")


class BlasRoutingWarning(RuntimeWarning):
    """MLX's matmuls could not be routed to OpenBLAS and will be slow."""


@dataclass(frozen=True)
class BlasStatus:
    routed: bool  # True when MLX's GEMM calls reach OpenBLAS through the shim
    reason: str  # one sentence on why (or why not)
    shim_path: str | None = None


status = BlasStatus(routed=False, reason="routing not attempted yet")
_shim: ctypes.CDLL | None = None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    path = Path(os.environ.get("SEQLIB_CACHE_DIR", os.path.join(base, "seqlib")))
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir())


def _openblas_dir() -> str:
    import scipy_openblas32  # the OpenBLAS wheel NumPy and SciPy build against

    return scipy_openblas32.get_lib_dir()


def _build_shim(openblas_dir: str) -> Path:
    """Compile the shim once per (source, OpenBLAS location); return its path."""
    source = SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + openblas_dir.encode()).hexdigest()[:16]
    target = _cache_dir() / f"blas_shim-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler, "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
        str(SHIM_SOURCE), "-o", str(partial),
        f"-L{openblas_dir}", "-lscipy_openblas", f"-Wl,-rpath,{openblas_dir}",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    os.replace(partial, target)  # atomic: parallel imports never see half a file
    return target


def _mlx_calls_the_shim(shim: ctypes.CDLL) -> bool:
    """Run one small MLX matmul and see whether it went through the shim."""
    import mlx.core as mx

    counter = shim.seqlib_blas_shim_calls
    counter.restype = ctypes.c_int64
    before = counter()
    a = mx.ones((8, 8), dtype=mx.float32, stream=mx.cpu)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    return counter() > before


def route_mlx_blas() -> BlasStatus:
    """Route MLX's BLAS to OpenBLAS if possible; return and remember the outcome."""
    global status, _shim
    if status.routed:
        return status
    if sys.platform != "linux":
        status = BlasStatus(False, "not Linux: MLX already uses an optimised BLAS")
        return status
    if os.environ.get(ENV_VAR, "1").strip().lower() in {"0", "off", "false", "no"}:
        status = BlasStatus(False, f"turned off by {ENV_VAR}={os.environ[ENV_VAR]}")
        return status

    mlx_loaded_first = "mlx.core" in sys.modules
    try:
        shim_path = _build_shim(_openblas_dir())
        _shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
    except (ImportError, OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        reason = f"could not build or load the OpenBLAS shim ({error} {detail.decode()[:200]})"
        return _give_up(reason.strip())

    if _mlx_calls_the_shim(_shim):
        status = BlasStatus(True, "MLX's cblas_*gemm calls go to OpenBLAS", str(shim_path))
        return status
    if mlx_loaded_first:
        return _give_up("mlx.core was imported before seqlib, so its BLAS was already bound; "
                        "import seqlib first")  # fmt: skip
    return _give_up("MLX did not call the shim's cblas_sgemm")


def _give_up(reason: str) -> BlasStatus:
    global status
    status = BlasStatus(False, reason)
    warnings.warn(
        f"seqlib: MLX matmuls stay on the slow reference BLAS: {reason} "
        f"(set {ENV_VAR}=0 to silence)",
        BlasRoutingWarning,
        stacklevel=3,
    )
    return status
