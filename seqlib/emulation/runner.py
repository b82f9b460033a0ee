"""``metal_kernel``: ``mx.fast.metal_kernel``'s stand-in that runs the kernel as C++ on the CPU.

Each call of a kernel:

1. generates MLX's exact source text for the call (:mod:`.codegen`),
2. compiles it with the host C++ compiler against ``include/metal_emulation.h``
   (cached by a hash of the text, in memory and on disk),
3. copies the inputs into buffers with guard zones before and after them
   (NaN for floats, huge values for integers, so stray reads show), pre-fills
   the outputs with NaN (or ``init_value``) and their guard zones with a marker,
4. runs every threadgroup, its threads as fibers, in the order set by
   :func:`options` (forward, reverse or random), counting barriers, atomics
   and SIMD collectives for :func:`record`, and
5. checks that no output guard was touched, then returns MLX arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from seqlib.emulation import codegen
from seqlib.emulation.compiler import COMPILER_ENV, EmulationError, compile_library
from seqlib.emulation.recording import (
    Instruments,
    Launch,
    ThreadCounters,
    count_launch,
    open_recorders,
)

__all__ = ["EmulatedKernel", "metal_kernel", "options"]

GUARD = 64  # elements of guard zone on each side of every buffer
ORDERS = ("forward", "reverse", "random")

_launch_lock = threading.Lock()


# ----------------------------------------------------------------- options


@dataclass(frozen=True)
class _Options:
    order: str = "forward"
    seed: int = 0
    pad_grid: bool = False
    nan_fill: bool = True
    guards: bool = True

    def __post_init__(self):
        if not isinstance(self.order, str) or self.order not in ORDERS:
            raise ValueError(f"order: expected one of {list(ORDERS)}, got {self.order!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise TypeError(f"seed: expected an int, got {type(self.seed).__name__}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed: expected an int in [0, 2**32), got {self.seed}")
        for name in ("pad_grid", "nan_fill", "guards"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")


_options = _Options()


@contextlib.contextmanager
def options(
    order: str = "forward", seed: int = 0, pad_grid: bool = False, nan_fill: bool = True, guards: bool = True
) -> Iterator[None]:
    """Run emulated kernels inside the block with these settings (the defaults apply outside any block).

    Args:
        order: the order in which threads run, within each threadgroup and
            across threadgroups: ``"forward"`` (thread 0 first), ``"reverse"``
            or ``"random"`` (a fresh shuffle at every scheduling pass).  A
            kernel that reads another thread's result without a barrier
            gives a different answer (usually NaN) under some order.
        seed: seed of the ``"random"`` order, an int in [0, 2**32).
        pad_grid: round the grid up to whole threadgroups, as a launcher that
            dispatches whole groups would; the extra threads must write nothing.
        nan_fill: where ``init_value`` is None, fill the outputs with NaN
            (integers: a huge marker) before the launch, so an element no
            thread writes shows; False fills them with zeros.
        guards: put guard zones around every buffer: inputs' hold NaN (or a
            huge integer) so that stray reads show, outputs' a marker that is
            checked after the launch (a write outside an output raises
            :class:`EmulationError`).  False: no guard zones, no check.

    Blocks nest; the innermost one applies.
    """
    global _options
    chosen = _Options(order, seed, pad_grid, nan_fill, guards)
    saved = _options
    _options = chosen
    try:
        yield
    finally:
        _options = saved



# ----------------------------------------------------------------- buffers

_NUMPY_DTYPES = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # the bits
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.bool_: np.bool_,
}

# What a stray read finds (and, with nan_fill, what an unwritten output holds): NaN or a huge integer.
_POISON = {
    mx.float32: np.nan,
    mx.float16: np.nan,
    mx.bfloat16: 0x7FC1,  # a NaN's bits
    mx.int8: 2**6,
    mx.int16: 2**14,
    mx.int32: 2**30,
    mx.int64: 2**40,
    mx.uint8: 0xA5,
    mx.uint16: 2**14,
    mx.uint32: 2**30,
    mx.uint64: 2**40,
    mx.bool_: True,
}

# What an output's guard zones hold; any change means the kernel wrote out of bounds.
_GUARD_MARKER = {
    mx.float32: 1.5e4,
    mx.float16: 1.5e4,
    mx.bfloat16: 0x4A6A,  # 3.83e6
    mx.int8: -99,
    mx.int16: -12345,
    mx.int32: -12345,
    mx.int64: -12345,
    mx.uint8: 0x5A,
    mx.uint16: 0x5A5A,
    mx.uint32: 0x5A,
    mx.uint64: 0x5A,
    mx.bool_: False,
}


def _check_dtype(what: str, dtype) -> None:
    if dtype not in _NUMPY_DTYPES:
        supported = ", ".join(str(d).split(".")[-1] for d in _NUMPY_DTYPES)
        raise TypeError(f"{what}: the emulation supports {supported}; got {dtype}")


def _to_numpy(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16))
    return np.array(array)


def _from_numpy(values: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(values.astype(np.uint16)).view(mx.bfloat16)
    return mx.array(values)


class _Buffer:
    """Values with a guard zone of ``guard`` elements on both sides."""

    def __init__(self, values: np.ndarray, guard_value, guard: int):
        flat = np.ascontiguousarray(values).reshape(-1)
        self.size = flat.size
        self.guard = guard
        self.storage = np.full(flat.size + 2 * guard, guard_value, dtype=flat.dtype)
        self.storage[guard : guard + flat.size] = flat
        self.guards = self._guard_bytes()

    def _guard_bytes(self) -> bytes:
        return self.storage[: self.guard].tobytes() + self.storage[self.guard + self.size :].tobytes()

    @property
    def pointer(self) -> int:
        return self.storage.ctypes.data + self.guard * self.storage.itemsize

    @property
    def values(self) -> np.ndarray:
        return self.storage[self.guard : self.guard + self.size]

    def guards_intact(self) -> bool:
        return self._guard_bytes() == self.guards



# ----------------------------------------------------------------- the kernel


def _three_ints(name: str, value, minimum: int) -> list[int]:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"{name}: expected 3 ints (x, y, z), got {value!r}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{name}: expected 3 ints (x, y, z), got {value!r}")
    if any(v < minimum for v in value):
        raise ValueError(f"{name}: expected 3 ints >= {minimum}, got {tuple(value)}")
    return [int(v) for v in value]


class EmulatedKernel:
    """A kernel made by :func:`metal_kernel`; call it exactly like a kernel made by ``mx.fast.metal_kernel``."""

    def __init__(self, name, input_names, output_names, source, header, atomic_outputs):
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.atomic_outputs = atomic_outputs
        self.uses_fibers = any(word in source + header for word in ("barrier", "simd_"))
        self._compiled: dict[tuple, ctypes.CDLL] = {}

    def text(self, inputs, output_dtypes, template=None) -> str:
        """MLX's generated source for a call with these inputs (what ``verbose=True`` prints)."""
        inputs = [value if isinstance(value, mx.array) else mx.array(value) for value in inputs]
        return codegen.kernel_text(
            self.name, self.source, self.header, self._specs(inputs), self.output_names, list(output_dtypes),
            template, self.atomic_outputs,
        )  # fmt: skip

    def _specs(self, inputs) -> list[codegen.InputSpec]:
        return [
            codegen.InputSpec(name, array.dtype, array.ndim, array.size)
            for name, array in zip(self.input_names, inputs, strict=True)
        ]

    def _library(self, text, specs, output_dtypes, template, kinds) -> ctypes.CDLL:
        """The compiled launcher for this text and these parameter kinds (cached on the kernel)."""
        key = (text, tuple(kinds), os.environ.get(COMPILER_ENV, ""))
        if key not in self._compiled:
            function = codegen.function_name(self.name, specs, output_dtypes, template)
            attributes = codegen.used_attributes(self.source)
            cpp = codegen.emulation_source(text, function, template, kinds, attributes, self.uses_fibers)
            self._compiled[key] = compile_library(cpp)
        return self._compiled[key]

    def _check_call(self, inputs, output_shapes, output_dtypes):
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"inputs: kernel {self.name!r} takes {len(self.input_names)} ({', '.join(self.input_names)}), "
                f"got {len(inputs)}"
            )
        for what, given in (("output_shapes", output_shapes), ("output_dtypes", output_dtypes)):
            if len(given) != len(self.output_names):
                raise ValueError(
                    f"{what}: kernel {self.name!r} has {len(self.output_names)} outputs "
                    f"({', '.join(self.output_names)}), got {len(given)}"
                )
        for name, array in zip(self.input_names, inputs, strict=True):
            _check_dtype(f"input {name!r}", array.dtype)
        for name, dtype in zip(self.output_names, output_dtypes, strict=True):
            _check_dtype(f"output_dtypes ({name!r})", dtype)

    def _input_buffers(self, inputs, specs, guard: int) -> tuple[list[_Buffer], list[tuple[str, str]]]:
        """Each input's buffer, followed by its shape, strides and ndim where the body names them, with the
        (C type, "pointer" or "reference") of each parameter."""
        buffers, kinds = [], []
        for spec, array in zip(specs, inputs, strict=True):
            buffers.append(_Buffer(_to_numpy(array), _POISON[array.dtype], guard))
            kinds.append((f"const {codegen.DTYPE_NAMES[array.dtype]}", "reference" if spec.is_scalar else "pointer"))
            if spec.ndim == 0:
                continue
            uses_shape, uses_strides, uses_ndim = codegen.shape_uses(self.source, spec.name)
            if uses_shape:
                buffers.append(_Buffer(np.array(array.shape, np.int32), _POISON[mx.int32], guard))
                kinds.append(("const int", "pointer"))
            if uses_strides:  # always row-contiguous: the inputs were copied so
                strides = np.cumprod([*array.shape[1:], 1][::-1])[::-1].astype(np.int64)
                buffers.append(_Buffer(strides, _POISON[mx.int64], guard))
                kinds.append(("const int64_t", "pointer"))
            if uses_ndim:
                buffers.append(_Buffer(np.array([array.ndim], np.int32), _POISON[mx.int32], guard))
                kinds.append(("const int", "reference"))
        return buffers, kinds

    def _output_buffers(self, output_shapes, output_dtypes, init_value, settings: _Options, guard: int):
        buffers, kinds = [], []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            if init_value is not None:
                fill = init_value
            else:
                fill = _POISON[dtype] if settings.nan_fill else 0
            values = np.full(int(np.prod(shape, dtype=np.int64)), fill, dtype=_NUMPY_DTYPES[dtype])
            buffers.append(_Buffer(values, _GUARD_MARKER[dtype], guard))
            c_type = codegen.DTYPE_NAMES[dtype]
            kinds.append((f"atomic<{c_type}>" if self.atomic_outputs else c_type, "pointer"))
        return buffers, kinds

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ) -> list[mx.array]:
        """Run the kernel on the CPU; same arguments and result as a kernel from ``mx.fast.metal_kernel``.

        ``stream`` is accepted and ignored (everything runs on the CPU, now).
        Raises :class:`EmulationError` if the kernel does not compile, fails
        in a way a GPU would not allow (a barrier some threads skip,
        divergent SIMD collectives, more than 32 KB of threadgroup memory, a
        memory fault) or writes outside an output.
        """
        settings = _options
        inputs = [value if isinstance(value, mx.array) else mx.array(value) for value in inputs]
        output_shapes = [tuple(int(size) for size in shape) for shape in output_shapes]
        output_dtypes = list(output_dtypes)
        self._check_call(inputs, output_shapes, output_dtypes)
        grid = _three_ints("grid", grid, 0)
        threadgroup = _three_ints("threadgroup", threadgroup, 1)

        specs = self._specs(inputs)
        text = codegen.kernel_text(
            self.name, self.source, self.header, specs, self.output_names, output_dtypes, template,
            self.atomic_outputs,
        )  # fmt: skip
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```", flush=True)

        guard = GUARD if settings.guards else 0
        buffers, kinds = self._input_buffers(inputs, specs, guard)
        outputs, output_kinds = self._output_buffers(output_shapes, output_dtypes, init_value, settings, guard)
        buffers, kinds = buffers + outputs, kinds + output_kinds

        library = self._library(text, specs, output_dtypes, template, kinds)

        group = [min(t, g) for t, g in zip(threadgroup, grid, strict=True)]  # as MLX clamps it
        if settings.pad_grid:
            grid = [-(-g // t) * t if t else g for g, t in zip(grid, group, strict=True)]
        recorders = open_recorders()
        recording = None
        if recorders:
            recording = ThreadCounters(grid, outputs, output_shapes, any(writers for _, writers in recorders))
        status, message, instruments = self._launch(library, buffers, grid, group, settings, recording)

        if recorders:
            launch = self._record(inputs, output_shapes, output_dtypes, template, init_value, text, grid, group,
                                  instruments, recording)  # fmt: skip
            for launches, _ in recorders:
                launches.append(launch)
        if status != 0:
            raise EmulationError(f"{self.name}: {message}")
        for name, buffer in zip(self.output_names, outputs, strict=True):
            if not buffer.guards_intact():
                raise EmulationError(f"{self.name}: the kernel wrote outside output {name!r}")
        return [
            _from_numpy(buffer.values.reshape(shape), dtype)
            for buffer, shape, dtype in zip(outputs, output_shapes, output_dtypes, strict=True)
        ]

    @staticmethod
    def _launch(library, buffers, grid, group, settings: _Options, recording: ThreadCounters | None):
        pointers = (ctypes.c_void_p * len(buffers))(*[buffer.pointer for buffer in buffers])
        instruments = Instruments()
        held = recording.fill(instruments) if recording is not None else []
        message = ctypes.create_string_buffer(512)
        with _launch_lock:
            status = library.emu_launch(
                pointers, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*group), ORDERS.index(settings.order),
                ctypes.c_uint(settings.seed), ctypes.byref(instruments), message, ctypes.c_int(len(message)),
            )  # fmt: skip
            count_launch()
        del held
        return status, message.value.decode(errors="replace"), instruments

    def _record(self, inputs, output_shapes, output_dtypes, template, init_value, text, grid, group,
                instruments: Instruments, recording: ThreadCounters) -> Launch:  # fmt: skip
        groups = [-(-g // t) if t else 0 for g, t in zip(grid, group, strict=True)]
        return Launch(
            name=self.name,
            input_names=tuple(self.input_names),
            output_names=tuple(self.output_names),
            source=self.source,
            header=self.header,
            atomic_outputs=self.atomic_outputs,
            input_shapes=tuple(tuple(array.shape) for array in inputs),
            input_dtypes=tuple(array.dtype for array in inputs),
            output_shapes=tuple(output_shapes),
            output_dtypes=tuple(output_dtypes),
            template=list(template) if template else None,
            init_value=init_value,
            text=text,
            grid=(grid[0], grid[1], grid[2]),
            threadgroup=(group[0], group[1], group[2]),
            threadgroups=int(np.prod(groups)),
            threads=int(np.prod(grid)),
            barriers=instruments.barriers,
            barrier_waits=instruments.barrier_waits,
            atomics=instruments.atomics,
            simd_collectives=instruments.simd_collectives,
            thread_barriers=recording.thread_barriers,
            thread_atomics=recording.thread_atomics,
            thread_simd_collectives=recording.thread_simd,
            thread_writes=recording.thread_writes,
            writers=recording.writer_arrays(self.output_names),
        )


def metal_kernel(
    name: str,
    input_names,
    output_names,
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options=None,
) -> EmulatedKernel:
    """A Metal kernel that runs on the CPU: same arguments as ``mx.fast.metal_kernel``, same call.

    ``source`` is the kernel's *body*; MLX's signature is generated around it
    (one parameter per input and output, ``<input>_shape`` / ``_strides`` /
    ``_ndim`` where the body names them, one per thread-position attribute
    the body names) and the whole text is compiled as C++ with the host
    compiler (``$CXX``, else ``g++`` on Linux or ``clang++`` on macOS) the
    first time a call needs it, then cached by its text.

    Args:
        name: the kernel's name (it names the generated function).
        input_names: the parameter names of the inputs, in call order.
        output_names: the parameter names of the outputs.
        source: the body of the kernel, in the Metal Shading Language.
        header: text put before the kernel (helper functions).
        ensure_row_contiguous: accepted for compatibility; the emulation
            always copies the inputs row-contiguous.
        atomic_outputs: declare the outputs ``device atomic<T>*``.
        compile_options: accepted for compatibility (None or a dict such as
            ``{"math_mode": "fast"}``); the emulation computes in IEEE
            float whatever the math mode.

    Returns:
        A kernel called as ``kernel(inputs=[...], output_shapes=[...],
        output_dtypes=[...], grid=(x, y, z), threadgroup=(x, y, z),
        template=None, init_value=None, verbose=False, stream=None)``,
        which returns the list of outputs.  :func:`options` sets how it runs
        (thread order, fills, guards), :func:`record` what it reports.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    for what, names in (("input_names", input_names), ("output_names", output_names)):
        if isinstance(names, str) or not all(isinstance(item, str) for item in names):
            raise TypeError(f"{what}: expected a sequence of str, got {names!r}")
    if not output_names:
        raise ValueError("output_names: a kernel needs at least one output")
    for what, text in (("source", source), ("header", header)):
        if not isinstance(text, str):
            raise TypeError(f"{what}: expected a str, got {type(text).__name__}")
    if compile_options is not None and not isinstance(compile_options, dict):
        raise TypeError(f"compile_options: expected None or a dict, got {type(compile_options).__name__}")
    return EmulatedKernel(name, input_names, output_names, source, header, bool(atomic_outputs))
