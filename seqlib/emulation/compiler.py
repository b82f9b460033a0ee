"""Compiling an emulated kernel: finding the host C++ compiler and caching what it builds.

The emulation compiles each kernel's generated source, with
``include/metal_emulation.h``, into a shared library that :mod:`.runner` calls
through ``ctypes``.  Libraries are cached by a hash of the text, the header, the
flags and ``$CXX``, in memory and on disk (``$SEQLIB_EMULATION_CACHE``), built by
:mod:`seqlib._build` like the rest of seqlib's native code.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading
from pathlib import Path

from seqlib import _build
from seqlib._build import CompilerNotFoundError

__all__ = ["CompilerNotFoundError", "EmulationError", "cache_dir", "compile_library", "find_compiler"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
HEADER = INCLUDE_DIR / "metal_emulation.h"
# MSL is based on C++14: what a newer standard added (if constexpr, structured bindings, inline variables)
# fails here as Apple's compiler fails it. Warnings stay on (-w would silence -pedantic-errors too)
# except for the Metal attributes g++ does not know ([[kernel]], [[buffer(0)]]).
COMPILE_FLAGS = ["-std=c++14", "-pedantic-errors", "-Wno-attributes", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing"]
COMPILER_ENV = "CXX"
CACHE_ENV = "SEQLIB_EMULATION_CACHE"


class EmulationError(RuntimeError):
    """The kernel did something a GPU would not allow, wrote outside its outputs, or did not compile."""


def find_compiler() -> list[str]:
    """The command that compiles the kernels: ``$CXX`` if set, else ``g++`` (Linux) or ``clang++`` (macOS),
    then the other one, then ``c++`` (seqlib's one lookup rule, :func:`seqlib._build.find_compiler`).

    Raises:
        CompilerNotFoundError: ``$CXX`` names a program that is not there, or no compiler was found.
    """
    return _build.find_compiler("c++")


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SEQLIB_EMULATION_CACHE``, else ``emulation/`` in seqlib's cache."""
    folder = Path(os.environ.get(CACHE_ENV) or _build.cache_dir() / "emulation")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@functools.cache
def _header_text() -> str:
    return HEADER.read_text()


_compile_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}


def compile_library(cpp: str) -> ctypes.CDLL:
    """Compile one translation unit into a shared library, cached in memory and on disk by the hash of its
    text, the header, the flags and ``$CXX``."""
    key = _build.key_of(cpp, _header_text(), " ".join(COMPILE_FLAGS), os.environ.get(COMPILER_ENV, ""))
    if key in _libraries:
        return _libraries[key]
    with _compile_lock:
        library_path = cache_dir() / f"{key}.so"
        source_path = cache_dir() / f"{key}.cpp"
        compiler = find_compiler()
        if not library_path.exists():
            source_path.write_text(cpp)
        try:
            _build.build_once(library_path, lambda partial: [*compiler, *COMPILE_FLAGS, f"-I{INCLUDE_DIR}",
                                                              str(source_path), "-o", str(partial)])  # fmt: skip
        except subprocess.CalledProcessError as error:
            output = (error.stderr or error.stdout or b"").decode(errors="replace")[-4000:]
            raise EmulationError(
                f"the C++ compiler ({' '.join(compiler)}) rejected the kernel ({source_path}):\n{output}"
            ) from None
        library = ctypes.CDLL(str(library_path))
        library.emu_launch.restype = ctypes.c_int
        _libraries[key] = library
        return library
