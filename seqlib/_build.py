"""Building seqlib's C and C++ code: one compiler lookup, one cache, one lock.

Three things are compiled on the user's machine against what is installed there: the BLAS shim
(:mod:`seqlib._blas`), the C++ primitives (:mod:`seqlib.native`) and each emulated Metal kernel
(:mod:`seqlib.emulation`).  Each is built at most once per key (a hash of everything its binary
depends on) into a cache folder, under a file lock, so that parallel processes (pytest workers,
two notebooks, ``mlx.launch`` ranks) never build the same thing twice or load half a file.
``import seqlib`` builds nothing: each is built where it is first needed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPILER_ENVS = {"c": "CC", "c++": "CXX"}  # the environment variable that names each language's compiler
_CANDIDATES = {
    "c": ("cc", "gcc", "clang"),
    "c++": ("clang++", "g++", "c++") if sys.platform == "darwin" else ("g++", "clang++", "c++"),
}


class CompilerNotFoundError(RuntimeError):
    """No C or C++ compiler to build seqlib's code with (install one, or set ``CC``/``CXX``)."""


def find_compiler(language: str = "c++") -> list[str]:
    """The command that compiles ``language`` ("c" or "c++"): ``$CC``/``$CXX`` if set (it must exist), else
    the first of ``cc, gcc, clang`` (C) or ``g++, clang++, c++`` (C++; clang++ first on macOS) on PATH."""
    variable = COMPILER_ENVS[language]
    requested = os.environ.get(variable, "").strip()
    if requested:
        command = shlex.split(requested)
        if shutil.which(command[0]) is None:
            raise CompilerNotFoundError(f"{variable}={requested!r}: the compiler {command[0]!r} was not found; "
                                        f"install it, or set {variable} to a {language} compiler that exists")
        return command
    for name in _CANDIDATES[language]:
        if shutil.which(name) is not None:
            return [name]
    install = ("on macOS: `xcode-select --install`" if sys.platform == "darwin"
               else "on Debian/Ubuntu: `sudo apt install g++`; on Fedora: `sudo dnf install gcc-c++`")  # fmt: skip
    raise CompilerNotFoundError(f"seqlib needs a {language} compiler for this, and none of "
                                f"{', '.join(_CANDIDATES[language])} was found on PATH.  Install one ({install}), "
                                f"or set {variable} to its path.")  # fmt: skip


def cache_dir() -> Path:
    """Where seqlib caches what it builds: ``$SEQLIB_CACHE_DIR``, else ``~/.cache/seqlib`` (``$XDG_CACHE_HOME``),
    else a per-user folder in the temp dir when neither can be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else "user"
    for path in (Path(os.environ.get("SEQLIB_CACHE_DIR", os.path.join(base, "seqlib"))),
                 Path(tempfile.gettempdir()) / f"seqlib-{user}"):  # fmt: skip
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except OSError:
            continue
    raise OSError("seqlib found no writable cache folder (set SEQLIB_CACHE_DIR)")


def key_of(*parts: str | bytes) -> str:
    """A short hash of everything a build depends on (sources, flags, versions, the compiler)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_once(target: Path, compile_to: Callable[[Path], list[str]]) -> Path:
    """``target`` if it exists, else built: ``compile_to(partial)`` gives the command that writes the binary to
    ``partial``, which is then moved into place.  A file lock beside ``target`` makes a second process wait for
    the first build instead of starting its own.  Raises ``subprocess.CalledProcessError`` (with the compiler's
    output in ``stderr``) when the command fails."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not target.exists():  # another process may have built it while this one waited
            partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            subprocess.run(compile_to(partial), check=True, capture_output=True)
            os.replace(partial, target)  # atomic: a reader never sees half a file
    return target
