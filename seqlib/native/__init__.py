"""seqlib's CPU primitives: a C++ extension of MLX, built on first use against the installed MLX.

MLX's CPU backend runs an LSTM step as a matmul and about ten elementwise kernels, and
on x86 those kernels are scalar code.  ``recurrent_cpu.cpp`` adds MLX primitives
(``mlx::core::Primitive`` subclasses with ``eval_cpu``, MLX's documented way to add an
operation) that run a whole LSTM, GRU or Elman RNN layer-direction in one operation: per
time step one OpenBLAS call and one loop of gate math vectorised for the host's CPU.
It also copies a batch-first input time-major on several threads (MLX copies on one).
``bags_cpu.cpp`` pools embedding bags straight from the table, in one pass, forward and
backward; ``losses_cpu.cpp`` is softmax cross-entropy, ``optim_cpu.cpp`` Adam's update
(:class:`seqlib.optim.Adam`), each one pass on every core.  For streaming,
``lstm_step``/``gru_step``/``rnn_step`` run one time step of a cell or a stack of layers at once,
outside MLX's graph (an MLX graph per step at batch 1 costs more than the step).
:mod:`seqlib.scan`, :func:`seqlib.functional.embedding_bag`, :mod:`seqlib.losses` and
:class:`seqlib.optim.Adam` use them where :func:`available` says so; the MLX-ops path gives the
same numbers within float32 rounding and stays in place everywhere else (other dtypes, a
projected LSTM, the Metal kernels, macOS).  A call that no transformation traces runs the forward alone; under
``mx.grad`` the forward also saves what the backward primitive needs.

The extension is compiled with ``g++ -O3 -march=native`` by :mod:`seqlib._build` when the
package is installed (``setup.py``: about half a minute), and used where it was built for
this MLX version, nanobind version, Python, CPU and sources; otherwise (MLX upgraded since,
another machine, edited sources) it is compiled where it is first needed, never at import,
once into ``SEQLIB_CACHE_DIR`` (default ``~/.cache/seqlib``) under a file lock.  Its ``cblas_sgemm`` is the BLAS
shim's (OpenBLAS), loaded before it, whether or not :func:`seqlib.route_mlx_blas` routed MLX.  It binds to
MLX's own Python types through nanobind (MLX's nanobind domain ``mlx``), and checks
itself against the MLX-ops path once it is loaded.  Where it cannot be built or loaded
(no C++ compiler, no nanobind, another MLX ABI) one :class:`NativeWarning` says why and
the ops path runs.  ``SEQLIB_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

from seqlib import _blas, _build

__all__ = ["ENV_VAR", "NativeWarning", "available", "extension", "module", "reason", "serves"]

#: The environment variable that turns the primitives off (SEQLIB_NATIVE=0).
ENV_VAR = "SEQLIB_NATIVE"
#: The C++ sources, compiled into one module (module.cpp binds the others' operations).
SOURCES = _build.NATIVE_SOURCES
HEADER = _build.NATIVE_HEADER
_MODULE = _build.NATIVE_MODULE


class NativeWarning(RuntimeWarning):
    """seqlib's C++ CPU primitives could not be built or loaded: the slower MLX-ops path runs."""


_state: dict = {}  # "module" (the loaded extension or None) and "reason", once decided


def _build_extension() -> Path:
    """The extension built at install (where its key matches this MLX, nanobind, Python and CPU), else compiled
    once into the cache (:func:`seqlib._build.build_once`: under a file lock)."""
    import mlx.core as mx
    import nanobind

    key = _build.native_key(mx.__version__, nanobind.__version__)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    packaged = _build.prebuilt(Path(__file__).with_name(f"{_MODULE}{suffix}"), key)
    if packaged is not None:
        return packaged
    mlx_dir = Path(mx.__file__).parent
    target = _build.cache_dir() / f"native-{_build.key_of(key, str(mlx_dir), *_build.find_compiler('c++'))}"
    return _build.build_once(target / f"{_MODULE}{suffix}", lambda partial: _build.native_command(mlx_dir, partial))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(module) -> None:
    """One small forward and backward against the MLX-ops path; a ValueError if they disagree."""
    import mlx.core as mx

    from seqlib import scan
    from seqlib.pointwise import lstm_pointwise

    keys = mx.random.split(mx.random.key(0), 4)
    x_gates, w_hh = mx.random.normal((6, 8), key=keys[0]), mx.random.normal((8, 2), key=keys[1]) * 0.5
    h0, c0 = mx.random.normal((3, 2), key=keys[2]), mx.random.normal((3, 2), key=keys[3])
    output = module.lstm_sequence(x_gates, w_hh, h0, c0, [3, 2, 1], False, False)[0]
    h, c, rows = h0, c0, 0
    for size in (3, 2, 1):
        want_h, want_c, _, _ = lstm_pointwise(x_gates[rows:rows + size] + h[:size] @ w_hh.T, c[:size], compiled=False)
        error = float(mx.abs(output[rows:rows + size] - want_h).max())
        if not error < 1e-5:
            raise ValueError(f"the forward differs from the MLX-ops path by {error:.1e}")
        h = mx.concatenate([want_h, h[size:]])
        c = mx.concatenate([want_c, c[size:]])
        rows += size
    # the gradients through the primitive's own backward (from what its forward saved) and the MLX-ops path's
    cotangents = [mx.ones_like(output), mx.zeros_like(h0), mx.zeros_like(c0)]
    gradients = []
    for function in (lambda *a: module.lstm_sequence(*a, [3, 2, 1], False, True)[:3],
                     scan._lstm_sequence_function((3, 2, 1), False, False, False)):  # fmt: skip
        gradients.append(mx.vjp(lambda *a, f=function: f(*a)[:3], [x_gates, w_hh, h0, c0], cotangents)[1])
    error = max(float(mx.abs(ours - want).max()) for ours, want in zip(*gradients, strict=True))
    if not error < 1e-5:
        raise ValueError(f"the backward differs from the MLX-ops path by {error:.1e}")
    table = mx.random.normal((5, 3), key=keys[0])  # bags [4, 0, 4], [], [2], averaged
    pooled = module.bag_pool(table, mx.array([4, 0, 4, 2]), mx.array([0, 3, 3, 4]), None, 1, -1)
    want = mx.stack([table[mx.array([4, 0, 4])].sum(axis=0) / 3, mx.zeros(3), table[2]])
    error = float(mx.abs(pooled - want).max())
    if not error < 1e-5:
        raise ValueError(f"the bag pooling differs from the MLX-ops path by {error:.1e}")


def module():
    """The loaded extension module, whether or not its primitives are in use (``SEQLIB_NATIVE=0`` leaves
    :mod:`seqlib.graph`'s introspection on), or None where it cannot be built or loaded (see :func:`reason`)."""
    if "loaded" in _state:
        return _state["loaded"]
    loaded, why = None, ""
    if sys.platform != "linux":
        why = "not Linux: MLX runs seqlib's Metal kernels or its own CPU code there"
    else:
        try:
            _blas.load_shim()  # the extension's cblas_sgemm binds to it: OpenBLAS, whether MLX is routed or not
            loaded = _load(_build_extension())
        except (ImportError, OSError, ValueError, TypeError, RuntimeError, subprocess.CalledProcessError) as error:
            detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace")[-300:]
            why = f"{type(error).__name__}: {error} {detail}".strip()
            warnings.warn(f"seqlib: the C++ CPU primitives are not available ({why}); the MLX-ops path runs "
                          f"(set {ENV_VAR}=0 to silence)", NativeWarning, stacklevel=3)  # fmt: skip
    _state.update(loaded=loaded, load_reason=why)
    return loaded


def extension():
    """The loaded extension module where its primitives run, or None where the MLX-ops path must run
    (see :func:`reason`)."""
    if "module" in _state:
        return _state["module"]
    found, why = None, ""
    if os.environ.get(ENV_VAR, "1").strip().lower() in {"0", "off", "false", "no"}:
        why = f"turned off by {ENV_VAR}={os.environ[ENV_VAR]}"
    elif module() is None:
        why = _state["load_reason"]
    else:
        try:
            _self_check(module())
            found, why = module(), "built and checked against the MLX-ops path"
        except (ValueError, TypeError, RuntimeError) as error:
            why = f"{type(error).__name__}: {error}"
            warnings.warn(f"seqlib: the C++ CPU primitives failed their check ({why}); the MLX-ops path runs "
                          f"(set {ENV_VAR}=0 to silence)", NativeWarning, stacklevel=3)  # fmt: skip
    _state.update(module=found, reason=why)
    return found


def available() -> bool:
    """Whether seqlib's C++ CPU primitives run here (built, loaded and checked; decided on the first call)."""
    return extension() is not None


def reason() -> str:
    """One sentence on why the primitives are or are not available."""
    extension()
    return _state["reason"]


def serves(dtype, backend: str | None = None) -> bool:
    """Whether the primitives run an operation on arrays of ``dtype`` here: float32, on MLX's CPU
    device, on the ``"ops"`` backend (no Metal kernels, not ``"plain"``: see :mod:`seqlib.kernels`), and
    :func:`available`.  :mod:`seqlib.dispatch` asks it for its ``"native"`` path, passing the ``backend`` it
    read (else it is read here).
    """
    import mlx.core as mx

    if backend is None:
        from seqlib.kernels.runtime import backend as current_backend

        backend = current_backend()
    return dtype == mx.float32 and backend == "ops" and mx.default_device() == mx.cpu and available()
