"""Where seqlib's Metal kernels come from and where they run: sources, the backend switch, building.

The kernels are plain ``.metal`` files: the *bodies* that ``mx.fast.metal_kernel``
wraps in a generated signature, plus one shared header (``seqlib_math.h``).  In a
source checkout they sit in the top-level ``metal_kernels/`` folder; an installed
wheel ships them as package data in ``seqlib/metal_kernels/``.

Backends (``SEQLIB_BACKEND`` or :func:`use_backend`):

- ``"metal"``: the kernels on the GPU (an Apple-silicon Mac);
- ``"emulate"``: the same kernels through :mod:`seqlib.emulation`, compiled as C++
  and run on the CPU, on any machine with a C++ compiler (slow: for learning and testing);
- ``"ops"``: plain MLX ops (:mod:`seqlib.pointwise`, :mod:`seqlib.scan`,
  :mod:`seqlib.functional`), same numbers within float32 rounding;
- ``"plain"``: MLX's built-in primitives only (no seqlib C++ primitive, kernel, custom
  function or compiled function inside), the path :func:`seqlib.export_function` takes,
  since ``mx.export_function`` serialises only MLX's own primitives;
- ``"auto"`` (the default): ``"metal"`` where Metal is available, else ``"ops"``.

Which implementation then runs a given call is decided in one place, :mod:`seqlib.dispatch`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from seqlib import emulation

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "HEADER_NAME",
    "KERNEL_BACKENDS",
    "KERNEL_DIR_ENV",
    "KERNEL_DTYPES",
    "KernelSpec",
    "T",
    "backend",
    "build_kernel",
    "check_kernel_dtype",
    "elementwise_launch",
    "forget_built_kernels",
    "int_scalar",
    "kernel_dir",
    "kernel_header",
    "kernel_names",
    "kernel_source",
    "metal_available",
    "use_backend",
    "uses_kernels",
]

# ----------------------------------------------------------------- sources

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_CANDIDATES = (
    _PACKAGE_DIR / "metal_kernels",  # installed wheel (package data)
    _PACKAGE_DIR.parent / "metal_kernels",  # source checkout / editable install
)
#: The shared header of the kernel bodies (named constants, the precise tanh), in :func:`kernel_dir`.
HEADER_NAME = "seqlib_math.h"
#: The environment variable that points :func:`kernel_dir` at another folder of ``.metal`` sources.
KERNEL_DIR_ENV = "SEQLIB_KERNEL_DIR"


def kernel_dir() -> Path:
    """The folder holding the ``.metal`` sources (``$SEQLIB_KERNEL_DIR`` if set: for trying edited kernels)."""
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    for folder in _CANDIDATES:
        if any(folder.glob("*.metal")):
            return folder
    searched = ", ".join(str(folder) for folder in _CANDIDATES)
    raise FileNotFoundError(f"seqlib's Metal kernel sources were not found (looked in {searched})")


def kernel_names() -> list[str]:
    """The names of all available kernels (file names without ``.metal``)."""
    return sorted(path.stem for path in kernel_dir().glob("*.metal"))


def kernel_source(name: str) -> str:
    """The text of ``metal_kernels/<name>.metal``, the body of kernel ``name`` that MLX wraps in a signature."""
    names = kernel_names()
    if name not in names:
        raise ValueError(f"name: no Metal kernel called {name!r}; available: {', '.join(names)}")
    return (kernel_dir() / f"{name}.metal").read_text()


def kernel_header() -> str:
    """The helpers every kernel is built with (``metal_kernels/seqlib_math.h``)."""
    return (kernel_dir() / HEADER_NAME).read_text()


# ----------------------------------------------------------------- backend choice

#: The environment variable that picks the backend for the whole process (one of :data:`BACKENDS`).
BACKEND_ENV = "SEQLIB_BACKEND"
#: The backend names. ``"metal"`` runs the kernels on the GPU, ``"emulate"`` on the CPU (through
#: :mod:`seqlib.emulation`), ``"ops"`` uses MLX ops (and seqlib's C++ CPU primitives where they serve),
#: ``"plain"`` MLX's built-in primitives only, ``"auto"`` is ``"metal"`` with Metal, else ``"ops"``.
BACKENDS = ("auto", "metal", "emulate", "ops", "plain")
_override: list[str] = []  # innermost use_backend() last


def metal_available() -> bool:
    """Whether this machine can run Metal kernels (an Apple-silicon Mac)."""
    return mx.metal.is_available()


def _requested() -> str:
    if _override:
        return _override[-1]
    choice = os.environ.get(BACKEND_ENV)
    if choice is None:  # read at every call (a streamed step's few microseconds): the common case first
        return "auto"
    choice = choice.strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKENDS}, got {choice!r}")
    return choice


def backend() -> str:
    """``"metal"``, ``"emulate"``, ``"ops"`` or ``"plain"``: the path seqlib's modules take now."""
    choice = _requested()
    if choice == "auto":
        return "metal" if metal_available() else "ops"
    if choice == "metal" and not metal_available():
        raise RuntimeError(
            f"backend 'metal' was requested ({BACKEND_ENV} or use_backend), but Metal is not available "
            "on this machine; use 'emulate' (the kernels on the CPU), 'ops' or 'auto'"
        )
    return choice


#: The backends on which seqlib's modules run the Metal kernels (on the GPU, or emulated on the CPU).
KERNEL_BACKENDS = ("metal", "emulate")


def uses_kernels() -> bool:
    """Whether seqlib's modules run the Metal kernels now (on the GPU or emulated)."""
    return backend() in KERNEL_BACKENDS


@contextlib.contextmanager
def use_backend(name: str):
    """Run the block with seqlib's modules on ``"metal"``, ``"emulate"``, ``"ops"``, ``"plain"`` or ``"auto"``."""
    if name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    _override.append(name)
    try:
        backend()  # fail now, not at the first launch, if Metal was asked for and is missing
        yield
    finally:
        _override.pop()


# ----------------------------------------------------------------- building and launching

T = "T"  # in a KernelSpec: the floating dtype of the call (the template argument T where the kernel has one)


@dataclass(frozen=True)
class KernelSpec:
    """How seqlib builds ``metal_kernels/<name>.metal`` into a kernel: its buffers and template, in order.

    inputs, outputs: ``(name, dtype)`` pairs in buffer order; dtype is :data:`T` or an MLX dtype.
    scalars: the inputs passed as 0-d arrays (``const constant T& name`` in the signature).
    atomic: outputs are ``device atomic<T>*`` (scatter-adds).  template: an example
    instantiation, ``(name, value)`` pairs in MLX's order, for showing the generated source.
    """

    name: str
    inputs: tuple[tuple[str, object], ...]
    outputs: tuple[tuple[str, object], ...]
    template: tuple[tuple[str, object], ...] = (("T", T),)
    scalars: tuple[str, ...] = ()
    atomic: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        """The input buffers' names, in the order the launcher passes them (``input_names`` of the kernel)."""
        return tuple(name for name, _ in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """The output buffers' names, in the order the kernel returns them (``output_names`` of the kernel)."""
        return tuple(name for name, _ in self.outputs)


#: The kernels compute element offsets in 32-bit ``uint`` (``row * embedding_dim + d``): an array of this
#: many elements or more would wrap them silently, so no such array is passed to a kernel.
MAX_KERNEL_ELEMENTS = 2**32


def check_kernel_sizes(spec: KernelSpec, inputs, output_shapes) -> None:
    """Raise a ValueError naming the buffer if any input or output has :data:`MAX_KERNEL_ELEMENTS` or more
    elements (checked from shapes alone: nothing is evaluated)."""
    sizes = [(name, array.size) for name, array in zip(spec.input_names, inputs, strict=True)]
    sizes += [(name, math.prod(shape)) for name, shape in zip(spec.output_names, output_shapes, strict=True)]
    for name, size in sizes:
        if size >= MAX_KERNEL_ELEMENTS:
            raise ValueError(
                f"{spec.name}: '{name}' has {size:,} elements; the Metal kernels index with 32-bit offsets, "
                f"so each array must have fewer than 2**32 = {MAX_KERNEL_ELEMENTS:,} (use the MLX-ops backend, "
                "seqlib.kernels.use_backend('ops'), for larger tables)"
            )


@functools.cache
def _build(factory, spec: KernelSpec):
    kernel = factory(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=kernel_source(spec.name),
        header=kernel_header(),
        ensure_row_contiguous=True,
        atomic_outputs=spec.atomic,
    )

    def launch(*, inputs, output_shapes, **options):
        check_kernel_sizes(spec, inputs, output_shapes)
        return kernel(inputs=inputs, output_shapes=output_shapes, **options)

    return launch


def forget_built_kernels() -> None:
    """Drop the kernels built so far, so the next launch reads the ``.metal`` sources again
    (for tools that edit the sources under ``$SEQLIB_KERNEL_DIR`` while a process runs)."""
    _build.cache_clear()


def build_kernel(spec: KernelSpec):
    """The kernel ``spec`` describes, for the current backend: built by ``mx.fast.metal_kernel`` on Metal,
    by :func:`seqlib.emulation.metal_kernel` when emulating (both cache what they compile)."""
    factory = emulation.metal_kernel if backend() == "emulate" else mx.fast.metal_kernel
    return _build(factory, spec)


#: The storage dtypes the kernels take (their math is float32 whatever the storage); other dtypes run the ops path.
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check_kernel_dtype(name: str, array: mx.array) -> None:
    """Raise a TypeError unless ``array`` (already checked to be floating) has a dtype the kernels are built for."""
    if array.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: the Metal kernels take float32, float16 or bfloat16, got {array.dtype}")


def elementwise_launch(rows: int, columns: int) -> dict:
    """Grid for one thread per (row, column) element: x runs along a row, so loads coalesce."""
    return {"grid": (columns, rows, 1), "threadgroup": (64, 4, 1)}


def int_scalar(value: int) -> mx.array:
    """A 0-d int32 input (the kernel sees ``const constant int32_t&``)."""
    return mx.array(value, dtype=mx.int32)
