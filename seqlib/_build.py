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


# ----------------------------------------------------------------- what is built, and how
#
# The two libraries a seqlib install carries, built by setup.py when the package is installed (see
# build_at_install) and otherwise on first use into the cache: the BLAS shim (C) and the C++
# primitives.  Each is identified by a key of everything its binary depends on; a prebuilt library is
# used only where the key it was built with (written beside it) is the key of the running process.

PACKAGE_DIR = Path(__file__).resolve().parent
SHIM_SOURCE = PACKAGE_DIR / "_blas_shim.c"
NATIVE_DIR = PACKAGE_DIR / "native"
NATIVE_SOURCES = tuple(NATIVE_DIR / name for name in ("module.cpp", "recurrent_cpu.cpp", "bags_cpu.cpp",
                                                     "checks_cpu.cpp", "rows_cpu.cpp", "losses_cpu.cpp",
                                                     "optim_cpu.cpp"))  # fmt: skip
NATIVE_HEADER = NATIVE_DIR / "cpu_loop.h"
NATIVE_MODULE = "_seqlib_cpu"  # the extension module's name (NB_MODULE in module.cpp)
SHIM_NAME = "_blas_shim.so"  # the prebuilt shim, beside _blas_shim.c


def cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = [line for line in file.read().splitlines()[:40] if line.startswith(("model name", "flags"))]
    except OSError:
        import platform

        lines = [platform.processor()]
    return "\n".join(lines)


def shim_key(openblas_dir: str) -> str:
    """The shim depends on its source and on the OpenBLAS it forwards to (by name: scipy_openblas)."""
    return key_of(SHIM_SOURCE.read_bytes(), Path(openblas_dir).name)


def shim_command(openblas_dir: str, output: Path) -> list[str]:
    """The command that compiles the shim against ``openblas_dir``'s ``libscipy_openblas``."""
    return [*find_compiler("c"), "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-pthread", str(SHIM_SOURCE),
            "-o", str(output), f"-L{openblas_dir}", "-lscipy_openblas", f"-Wl,-rpath,{openblas_dir}"]  # fmt: skip


def native_key(mlx_version: str, nanobind_version: str) -> str:
    """The C++ primitives depend on their sources, MLX's version (its ABI), nanobind's, Python's and the CPU."""
    sources = [path.read_bytes() for path in (*NATIVE_SOURCES, NATIVE_HEADER)]
    return key_of(*sources, mlx_version, nanobind_version, sys.version, cpu_key())


def native_command(mlx_dir: Path, output: Path) -> list[str]:
    """The command that compiles the C++ primitives against the MLX in ``mlx_dir`` (headers and libmlx)."""
    import sysconfig

    import nanobind

    nanobind_dir = Path(nanobind.source_dir()).parent
    return [
        *find_compiler("c++"), "-O3", "-march=native", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC",
        "-fvisibility=hidden", "-DNB_DOMAIN=mlx", "-DNDEBUG",
        f"-I{nanobind.include_dir()}", f"-I{nanobind_dir / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}",
        str(Path(nanobind.source_dir()) / "nb_combined.cpp"), *map(str, NATIVE_SOURCES), "-o", str(output),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
    ]  # fmt: skip  (cblas_sgemm comes from the shim, loaded globally first)


def prebuilt(library: Path, key: str) -> Path | None:
    """``library`` where it was built (at install) with ``key``, else None."""
    stamp = library.with_name(library.name + ".key")
    try:
        return library if library.exists() and stamp.read_text().strip() == key else None
    except OSError:
        return None


def build_at_install(package_dir: Path) -> list[str]:
    """Build the shim and the C++ primitives into ``package_dir`` (seqlib's folder in a build or a source
    tree), each with its key beside it; called by setup.py.  Returns one line per library on what
    happened: a library that cannot be built (no compiler, no MLX) is left to the first-use build."""
    import importlib.machinery
    import subprocess

    report = []
    try:
        import scipy_openblas32

        openblas_dir = scipy_openblas32.get_lib_dir()
        shim = package_dir / SHIM_NAME
        subprocess.run(shim_command(openblas_dir, shim), check=True, capture_output=True)
        shim.with_name(shim.name + ".key").write_text(shim_key(openblas_dir))
        report.append(f"built {shim}")
    except (ImportError, OSError, CompilerNotFoundError, subprocess.CalledProcessError) as error:
        report.append(f"the BLAS shim is left to its first use ({type(error).__name__}: {error})")
    try:
        import mlx.core as mx
        import nanobind

        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        module = package_dir / "native" / f"{NATIVE_MODULE}{suffix}"
        subprocess.run(native_command(Path(mx.__file__).parent, module), check=True, capture_output=True)
        module.with_name(module.name + ".key").write_text(native_key(mx.__version__, nanobind.__version__))
        report.append(f"built {module}")
    except (ImportError, OSError, CompilerNotFoundError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace")[-300:]
        report.append(f"the C++ primitives are left to their first use ({type(error).__name__}: {error} {detail})")
    return report
