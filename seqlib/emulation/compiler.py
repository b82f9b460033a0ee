"""Compiling an emulated kernel: finding the host C++ compiler and caching what it builds.

The emulation compiles each kernel's generated source, with
``include/metal_emulation.h``, into a shared library that :mod:`.runner` calls
through ``ctypes``.  Libraries are cached by a hash of the text, the header, the
flags and ``$CXX``, in memory and on disk (``$SEQLIB_EMULATION_CACHE``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["CompilerNotFoundError", "EmulationError", "cache_dir", "compile_library", "find_compiler"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
HEADER = INCLUDE_DIR / "metal_emulation.h"
COMPILE_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-fno-strict-aliasing"]
COMPILER_ENV = "CXX"
CACHE_ENV = "SEQLIB_EMULATION_CACHE"


class EmulationError(RuntimeError):
    """The kernel did something a GPU would not allow, wrote outside its outputs, or did not compile."""


class CompilerNotFoundError(RuntimeError):
    """No C++ compiler to build the emulated kernels with (install one, or set ``CXX``)."""



def find_compiler() -> list[str]:
    """The command that compiles the kernels: ``$CXX`` if set, else ``g++`` (Linux) or ``clang++`` (macOS),
    then the other one, then ``c++``.

    Raises:
        CompilerNotFoundError: ``$CXX`` names a program that is not there, or no compiler was found.
    """
    requested = os.environ.get(COMPILER_ENV, "").strip()
    if requested:
        command = shlex.split(requested)
        if shutil.which(command[0]) is None:
            raise CompilerNotFoundError(
                f"{COMPILER_ENV}={requested!r}: the C++ compiler {command[0]!r} was not found; install it, "
                f"or set {COMPILER_ENV} to a C++20 compiler that exists (g++ or clang++)"
            )
        return command
    candidates = ("clang++", "g++", "c++") if sys.platform == "darwin" else ("g++", "clang++", "c++")
    for name in candidates:
        if shutil.which(name) is not None:
            return [name]
    install = (
        "on macOS: `xcode-select --install`"
        if sys.platform == "darwin"
        else "on Debian/Ubuntu: `sudo apt install g++`; on Fedora: `sudo dnf install gcc-c++`"
    )
    raise CompilerNotFoundError(
        f"seqlib.emulation needs a C++ compiler to run Metal kernels on the CPU, and none of "
        f"{', '.join(candidates)} was found on PATH.  Install one ({install}), or set {COMPILER_ENV} to its path."
    )


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$SEQLIB_EMULATION_CACHE``, else a per-user folder in the temp dir."""
    user = os.getuid() if hasattr(os, "getuid") else "user"
    default = Path(tempfile.gettempdir()) / f"seqlib-emu-{user}"
    folder = Path(os.environ.get(CACHE_ENV) or default)
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
    requested = os.environ.get(COMPILER_ENV, "")
    key_text = "\0".join([cpp, _header_text(), " ".join(COMPILE_FLAGS), requested])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:24]
    if key in _libraries:
        return _libraries[key]
    with _compile_lock:
        library_path = cache_dir() / f"{key}.so"
        if not library_path.exists():
            compiler = find_compiler()
            source_path = cache_dir() / f"{key}.cpp"
            source_path.write_text(cpp)
            partial = library_path.with_suffix(f".{os.getpid()}.tmp")
            command = [*compiler, *COMPILE_FLAGS, f"-I{INCLUDE_DIR}", str(source_path), "-o", str(partial)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                output = (result.stderr or result.stdout)[-4000:]
                raise EmulationError(
                    f"the C++ compiler ({' '.join(compiler)}) rejected the kernel ({source_path}):\n{output}"
                )
            partial.replace(library_path)
        library = ctypes.CDLL(str(library_path))
        library.emu_launch.restype = ctypes.c_int
        _libraries[key] = library
        return library

