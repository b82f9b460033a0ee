"""``metal_kernel``: a stand-in for ``mx.fast.metal_kernel`` that runs the kernel as C++ on the CPU.

It has the same call signature as MLX's kernel objects, so the tests hand it to
``seqlib.kernels`` in place of MLX's factory and everything above the kernel
(argument checks, launch geometry, custom VJPs, the modules) runs as on a Mac.

Each call:
1. generates MLX's exact source text for the call (:mod:`.codegen`),
2. compiles it with g++ against ``include/metal_emulation.h`` (cached by hash),
3. copies the inputs into buffers with guard zones before and after them
   (NaN for floats, huge values for integers, so stray reads show), pre-fills
   the outputs with NaN (or ``init_value``) and their guard zones with a marker,
4. runs every threadgroup, its threads as fibers in the order set by
   :func:`emulation` (forward, reverse or random), and
5. checks that no output guard was touched, then returns MLX arrays.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import codegen

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
HEADER = INCLUDE_DIR / "metal_emulation.h"
COMPILE_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-fno-strict-aliasing"]
GUARD = 64  # elements of guard zone on each side of every buffer
ORDERS = {"forward": 0, "reverse": 1, "random": 2}


class EmulationError(RuntimeError):
    """The kernel did something a GPU would not allow, or wrote outside its outputs."""


@dataclass
class Settings:
    order: str = "forward"
    seed: int = 0
    pad_grid: bool = False  # round the grid up to whole threadgroups (extra threads must do nothing)


_settings = Settings()
_compile_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}
launch_count = 0  # how many kernel launches ran (tests use it to prove the kernel path was taken)
recorded_calls: list[dict] = []  # every call's arguments, for the test that diffs our text against MLX's


@contextlib.contextmanager
def emulation(order: str = "forward", seed: int = 0, pad_grid: bool = False):
    """Run emulated kernels with this thread order and grid padding inside the block."""
    global _settings
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {list(ORDERS)}, got {order!r}")
    saved = _settings
    _settings = Settings(order, seed, pad_grid)
    try:
        yield
    finally:
        _settings = saved


def cache_dir() -> Path:
    folder = Path(os.environ.get("SEQLIB_EMULATION_CACHE", Path(tempfile.gettempdir()) / f"seqlib-emu-{os.getuid()}"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def compile_library(cpp: str) -> ctypes.CDLL:
    """Compile one translation unit (cached on disk and in memory by the hash of its text)."""
    key = hashlib.sha256((cpp + HEADER.read_text() + " ".join(COMPILE_FLAGS)).encode()).hexdigest()[:24]
    if key in _libraries:
        return _libraries[key]
    with _compile_lock:
        library_path = cache_dir() / f"{key}.so"
        if not library_path.exists():
            source_path = cache_dir() / f"{key}.cpp"
            source_path.write_text(cpp)
            partial = library_path.with_suffix(f".{os.getpid()}.tmp")
            command = ["g++", *COMPILE_FLAGS, f"-I{INCLUDE_DIR}", str(source_path), "-o", str(partial)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise EmulationError(f"g++ rejected the kernel ({source_path}):\n{result.stderr[-4000:]}")
            partial.rename(library_path)
        library = ctypes.CDLL(str(library_path))
        library.emu_launch.restype = ctypes.c_int
        _libraries[key] = library
        return library


# ----------------------------------------------------------------- buffers


def _to_numpy(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16))
    return np.array(array)


def _from_numpy(values: np.ndarray, dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(values.astype(np.uint16)).view(mx.bfloat16)
    return mx.array(values)


def _numpy_dtype(dtype: mx.Dtype):
    return {
        mx.float32: np.float32,
        mx.float16: np.float16,
        mx.bfloat16: np.uint16,
        mx.int32: np.int32,
        mx.int64: np.int64,
        mx.uint32: np.uint32,
        mx.uint8: np.uint8,
        mx.bool_: np.bool_,
    }[dtype]


def _poison(dtype: mx.Dtype):
    """What a stray read finds: NaN for floats, a huge index for integers."""
    if dtype == mx.bfloat16:
        return 0x7FC1
    if mx.issubdtype(dtype, mx.floating):
        return np.nan
    if dtype == mx.bool_:
        return True
    return {mx.int32: 2**30, mx.int64: 2**40, mx.uint32: 2**30, mx.uint8: 0xA5}[dtype]


def _guard_marker(dtype: mx.Dtype):
    """What an output's guard zones hold; any change means the kernel wrote out of bounds."""
    if dtype == mx.bfloat16:
        return 0x4A6A  # 3.83e6 as bfloat16 bits
    if mx.issubdtype(dtype, mx.floating):
        return 1.5e4
    return False if dtype == mx.bool_ else -12345 if dtype != mx.uint32 and dtype != mx.uint8 else 0x5A


class _Buffer:
    """Values with a guard zone of GUARD elements on both sides."""

    def __init__(self, values: np.ndarray, guard_value):
        flat = np.ascontiguousarray(values).reshape(-1)
        self.size = flat.size
        self.storage = np.full(flat.size + 2 * GUARD, guard_value, dtype=flat.dtype)
        self.storage[GUARD:GUARD + flat.size] = flat
        self.guards = np.concatenate([self.storage[:GUARD], self.storage[GUARD + flat.size:]]).copy()

    @property
    def pointer(self) -> int:
        return self.storage.ctypes.data + GUARD * self.storage.itemsize

    @property
    def values(self) -> np.ndarray:
        return self.storage[GUARD:GUARD + self.size]

    def guards_intact(self) -> bool:
        now = np.concatenate([self.storage[:GUARD], self.storage[GUARD + self.size:]])
        return now.tobytes() == self.guards.tobytes()


class EmulatedKernel:
    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):  # fmt: skip
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.atomic_outputs = atomic_outputs
        self.uses_fibers = any(word in source + header for word in ("barrier", "simd_"))

    def text(self, inputs, output_dtypes, template=None) -> str:
        """MLX's generated source for these inputs (what ``verbose=True`` prints)."""
        specs = self._specs(inputs)
        return codegen.kernel_text(
            self.name, self.source, self.header, specs, self.output_names, list(output_dtypes), template,
            self.atomic_outputs,
        )  # fmt: skip

    def _specs(self, inputs) -> list[codegen.InputSpec]:
        return [
            codegen.InputSpec(name, array.dtype, array.ndim, array.size)
            for name, array in zip(self.input_names, inputs, strict=True)
        ]

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None):  # fmt: skip
        global launch_count
        if len(inputs) != len(self.input_names):
            raise ValueError(f"{self.name}: expected {len(self.input_names)} inputs, got {len(inputs)}")
        inputs = [mx.array(value) if not isinstance(value, mx.array) else value for value in inputs]
        output_dtypes = list(output_dtypes)
        specs = self._specs(inputs)
        text = self.text(inputs, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")

        buffers, kinds = [], []
        for spec, array in zip(specs, inputs, strict=True):
            buffers.append(_Buffer(_to_numpy(array), _poison(array.dtype)))
            kinds.append((f"const {codegen.DTYPE_NAMES[array.dtype]}", "reference" if spec.is_scalar else "pointer"))
            if spec.ndim > 0:
                uses_shape, uses_strides, uses_ndim = codegen.shape_uses(self.source, spec.name)
                if uses_shape:
                    buffers.append(_Buffer(np.array(array.shape, np.int32), 2**30))
                    kinds.append(("const int", "pointer"))
                if uses_strides:
                    strides = np.cumprod([*array.shape[1:], 1][::-1])[::-1].astype(np.int64)
                    buffers.append(_Buffer(strides, 2**40))
                    kinds.append(("const int64_t", "pointer"))
                if uses_ndim:
                    buffers.append(_Buffer(np.array([array.ndim], np.int32), 2**30))
                    kinds.append(("const int", "reference"))
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            fill = _poison(dtype) if init_value is None else init_value
            values = np.full(int(np.prod(shape, dtype=np.int64)), fill, dtype=_numpy_dtype(dtype))
            outputs.append(_Buffer(values, _guard_marker(dtype)))
            c_type = codegen.DTYPE_NAMES[dtype]
            kinds.append((f"atomic<{c_type}>" if self.atomic_outputs else c_type, "pointer"))
        buffers += outputs

        function = codegen.function_name(self.name, specs, output_dtypes, template)
        attributes = codegen.used_attributes(self.source)
        cpp = codegen.emulation_source(text, function, template, kinds, attributes, self.uses_fibers)
        library = compile_library(cpp)

        grid = [int(g) for g in grid]
        group = [min(int(t), g) for t, g in zip(threadgroup, grid, strict=True)]
        if _settings.pad_grid:
            grid = [-(-g // t) * t if t else g for g, t in zip(grid, group, strict=True)]
        pointers = (ctypes.c_void_p * len(buffers))(*[buffer.pointer for buffer in buffers])
        grid_array = (ctypes.c_uint * 3)(*grid)
        group_array = (ctypes.c_uint * 3)(*group)
        message = ctypes.create_string_buffer(512)
        status = library.emu_launch(
            pointers, grid_array, group_array, ORDERS[_settings.order], ctypes.c_uint(_settings.seed),
            message, ctypes.c_int(512),
        )  # fmt: skip
        launch_count += 1
        recorded_calls.append({
            "name": self.name, "input_names": self.input_names, "output_names": self.output_names,
            "source": self.source, "header": self.header, "atomic_outputs": self.atomic_outputs,
            "inputs": [(tuple(a.shape), str(a.dtype)) for a in inputs],
            "template": [(key, v if isinstance(v, (bool, int)) else str(v)) for key, v in template or []],
            "output_shapes": [tuple(shape) for shape in output_shapes],
            "output_dtypes": [str(dtype) for dtype in output_dtypes], "text": text,
        })  # fmt: skip
        del recorded_calls[:-500]
        if status != 0:
            raise EmulationError(f"{self.name}: {message.value.decode()}")
        for name, buffer in zip(self.output_names, outputs, strict=True):
            if not buffer.guards_intact():
                raise EmulationError(f"{self.name}: the kernel wrote outside output {name!r}")
        return [
            _from_numpy(buffer.values.reshape(shape), dtype)
            for buffer, shape, dtype in zip(outputs, output_shapes, output_dtypes, strict=True)
        ]


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, **_ignored) -> EmulatedKernel:  # fmt: skip
    """Same arguments as ``mx.fast.metal_kernel``."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)
