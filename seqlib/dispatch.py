"""Which implementation runs a call: one table of paths, asked once per call.

Every module of seqlib has up to four implementations of its forward and backward, with
the same numbers within float32 rounding.  Each path says whether it serves a call on
arrays of a dtype on the backend chosen now (:func:`seqlib.kernels.backend`, read once per call); the
first that does runs it:

- ``plain``: MLX's built-in primitives only, with gradients by MLX's autodiff: no seqlib C++
  primitive, kernel, custom function or compiled function inside, so that ``mx.export_function``
  can serialise the graph.  On the ``"plain"`` backend (:func:`seqlib.kernels.use_backend`,
  ``SEQLIB_BACKEND=plain``, and inside :func:`seqlib.export_function`).
- ``kernels``: seqlib's Metal kernels (:mod:`seqlib.kernels`), on the GPU (``"metal"``) or run on
  the CPU through :mod:`seqlib.emulation` (``"emulate"``); float32, float16 and bfloat16.
- ``native``: seqlib's C++ CPU primitives (:mod:`seqlib.native`): float32 on MLX's CPU device,
  where the extension is built and checked.
- ``ops``: MLX ops with seqlib's hand-written backward (custom functions): everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from seqlib import native
from seqlib.kernels.runtime import KERNEL_DTYPES, KERNEL_BACKENDS, backend

__all__ = ["PATHS", "Path", "path_for"]


@dataclass(frozen=True)
class Path:
    """One implementation: its ``name``, what it is, and whether it ``serves(dtype, backend)`` a call now
    (``backend``: what :func:`seqlib.kernels.backend` returns)."""

    name: str
    description: str
    serves: Callable[[object, str], bool]


#: The paths in the order they are asked: the first that serves a call runs it.
PATHS = (
    Path("plain", "MLX's built-in primitives only (exportable)", lambda dtype, backend: backend == "plain"),
    Path("kernels", "seqlib's Metal kernels, on the GPU or emulated",
         lambda dtype, backend: backend in KERNEL_BACKENDS and dtype in KERNEL_DTYPES),
    Path("native", "seqlib's C++ CPU primitives", native.serves),
    Path("ops", "MLX ops with seqlib's hand-written backward", lambda dtype, backend: True),
)


def path_for(dtype) -> str:
    """The name of the first path in :data:`PATHS` that serves a call on arrays of ``dtype``."""
    now = backend()  # read once per call: a streamed step at batch 1 takes tens of microseconds in all
    for path in PATHS:
        if path.serves(dtype, now):
            return path.name
    raise AssertionError("the last path serves every call")
