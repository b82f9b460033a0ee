"""Give MLX's CPU backend an optimised BLAS on Linux.

MLX's Linux wheel links netlib's *reference* BLAS: a float32 matmul runs at a
few GFLOP/s there, 20-30x slower than NumPy on the same machine.  MLX calls only
``cblas_sgemm``, ``cblas_dgemm`` and ``cblas_cgemm``, so we build a tiny shim
library (``_blas_shim.c``) that defines exactly those three names and forwards
them to the OpenBLAS shipped by the ``scipy-openblas32`` wheel, load it with
``RTLD_GLOBAL`` and only then import ``mlx.core``.  The dynamic linker then
binds MLX's references to the shim instead of the reference BLAS.

Most MLX code imports ``mlx.core`` first, and Python loads extensions with
``RTLD_NOW``: by the time seqlib is imported, ``libmlx.so``'s three references
are already bound to the reference BLAS.  Then seqlib rebinds them itself: it
reads ``libmlx.so``'s relocation table for the three names, and writes the
shim's addresses into the slots of its global offset table, the same
pointers the dynamic linker had written there (:func:`_rebind_loaded_mlx`).
Only those three slots of that one library change.

Nothing else is exported, so PyTorch (or NumPy) in the same process keeps its
own BLAS and its speed.  On macOS nothing is done: MLX uses Accelerate.

Set ``SEQLIB_BLAS=0`` to turn the routing off.  If it cannot be done (no C
compiler, no scipy-openblas32, or a ``libmlx.so`` whose slots cannot be found)
a one-line :class:`BlasRoutingWarning` says so and MLX keeps its own BLAS.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import struct
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "SEQLIB_BLAS"
SHIM_SOURCE = Path(__file__).with_name("_blas_shim.c")
ROUTED_NAMES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")


class BlasRoutingWarning(RuntimeWarning):
    """MLX's matmuls could not be routed to OpenBLAS and will be slow."""


@dataclass(frozen=True)
class BlasStatus:
    routed: bool  # True when MLX's GEMM calls reach OpenBLAS through the shim
    reason: str  # one sentence on why (or why not)
    shim_path: str | None = None


status = BlasStatus(routed=False, reason="routing not attempted yet")
_shim: ctypes.CDLL | None = None


def cache_dir() -> Path:
    """Where seqlib caches what it builds: SEQLIB_CACHE_DIR, else ~/.cache/seqlib (a temp dir if unwritable)."""
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
    target = cache_dir() / f"blas_shim-{key}.so"
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

    if mlx_loaded_first:  # libmlx.so's references were bound when mlx.core was loaded: rebind them
        try:
            _rebind_loaded_mlx(_shim)
        except (OSError, ValueError) as error:
            return _give_up(f"mlx.core was imported before seqlib and its BLAS could not be rebound ({error}); "
                            "import seqlib first")  # fmt: skip
    if _mlx_calls_the_shim(_shim):
        how = "rebound after mlx.core was loaded" if mlx_loaded_first else "bound when mlx.core was loaded"
        status = BlasStatus(True, f"MLX's cblas_*gemm calls go to OpenBLAS ({how})", str(shim_path))
        return status
    return _give_up("MLX did not call the shim's cblas_sgemm")


# ----------------------------------------------------------------- rebinding an already loaded libmlx.so

_SHT_RELA, _PT_GNU_RELRO = 4, 0x6474E552
_SLOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # e_machine -> (GLOB_DAT, JUMP_SLOT): x86-64, AArch64


def _loaded_mlx_library() -> tuple[str, int]:
    """The path of the loaded libmlx.so (or of mlx.core's extension where MLX is one file) and its load bias."""
    import mlx.core

    candidates = [Path(mlx.core.__file__).parent / "lib" / "libmlx.so", Path(mlx.core.__file__)]
    path = next((str(candidate) for candidate in candidates if candidate.exists()), None)
    if path is None:
        raise OSError("libmlx.so not found next to mlx.core")
    libdl = ctypes.CDLL(None)
    libdl.dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    link_map = ctypes.c_void_p()
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # the copy already loaded, not a new one
    if libdl.dlinfo(handle._handle, 2, ctypes.byref(link_map)) != 0:  # 2: RTLD_DI_LINKMAP
        raise OSError(f"dlinfo failed for {path}")
    return path, ctypes.c_size_t.from_address(link_map.value).value  # struct link_map starts with l_addr


def _gemm_slots(path: str) -> tuple[dict[str, list[int]], tuple[int, int] | None]:
    """Offsets of the global-offset-table slots that hold ROUTED_NAMES in the ELF file at ``path``,
    and its RELRO range (start, end), read from the section and program headers."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        machine, = struct.unpack_from("<H", elf, 18)
        if machine not in _SLOT_RELOCATIONS:
            raise ValueError(f"unknown machine {machine} in {path}")
        program_offset, section_offset = struct.unpack_from("<QQ", elf, 32)
        program_size, program_count, section_size, section_count = struct.unpack_from("<HHHH", elf, 54)
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, section_offset + k * section_size)
                    for k in range(section_count)]  # fmt: skip
        slots: dict[str, list[int]] = {name: [] for name in ROUTED_NAMES}
        for _, kind, _, _, offset, size, link, _, _, entry_size in sections:
            if kind != _SHT_RELA:
                continue
            symbols, strings = sections[link], sections[sections[link][6]]
            for start in range(offset, offset + size, entry_size):
                slot, info, _ = struct.unpack_from("<QQq", elf, start)
                if info & 0xFFFFFFFF not in _SLOT_RELOCATIONS[machine]:
                    continue
                name_offset, = struct.unpack_from("<I", elf, symbols[4] + (info >> 32) * symbols[9])
                name_start = strings[4] + name_offset
                name = elf[name_start:elf.find(b"\0", name_start)].decode()
                if name in slots:
                    slots[name].append(slot)
        relro = None
        for k in range(program_count):
            kind, _, _, address, _, _, memory_size, _ = struct.unpack_from(
                "<IIQQQQQQ", elf, program_offset + k * program_size
            )
            if kind == _PT_GNU_RELRO:
                relro = (address, address + memory_size)
    return slots, relro


def _rebind_loaded_mlx(shim: ctypes.CDLL) -> None:
    """Point the loaded libmlx.so's cblas_*gemm slots at the shim's functions."""
    path, bias = _loaded_mlx_library()
    slots, relro = _gemm_slots(path)
    if not any(slots.values()):
        raise ValueError(f"no cblas_*gemm relocations in {path}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for name, offsets in slots.items():
        target = ctypes.cast(getattr(shim, name), ctypes.c_void_p).value
        for offset in offsets:
            address = bias + offset
            read_only = relro is not None and relro[0] <= offset < relro[1]  # full RELRO: made read-only
            if read_only and libc.mprotect(address - address % page, page, mmap.PROT_READ | mmap.PROT_WRITE):
                raise OSError(ctypes.get_errno(), f"mprotect failed on {path}'s slot for {name}")
            ctypes.c_void_p.from_address(address).value = target
            if read_only:
                libc.mprotect(address - address % page, page, mmap.PROT_READ)


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
