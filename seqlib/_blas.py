"""Give MLX's CPU backend an optimised BLAS on Linux, when asked: :func:`route_mlx_blas`.

MLX's Linux wheel links netlib's *reference* BLAS: a float32 matmul runs at a
few GFLOP/s there, 20-30x slower than NumPy on the same machine.  MLX calls only
``cblas_sgemm``, ``cblas_dgemm`` and ``cblas_cgemm``, so seqlib builds a tiny shim
library (``_blas_shim.c``) that defines exactly those three names and forwards
them to the OpenBLAS shipped by the ``scipy-openblas32`` wheel.

``import seqlib`` does none of this: a library imported into other people's
programs should not change the speed or the rounding of their MLX code.  Routing
is one explicit call, :func:`route_mlx_blas` (``seqlib.route_mlx_blas()``), which the
book makes in every chapter's first cell; ``SEQLIB_BLAS=1`` makes ``import seqlib``
call it, for programs that cannot be edited; ``SEQLIB_BLAS=0`` turns it off.  By
then ``mlx.core`` is loaded and Python loaded it with ``RTLD_NOW``, so
``libmlx.so``'s three references are bound to the reference BLAS: the call rebinds
them.  It reads ``libmlx.so``'s relocation table for the three names and writes the
shim's addresses into the slots of its global offset table, the same pointers the
dynamic linker had written there (:func:`_rebind_loaded_mlx`).  Only those three
slots of that one library change.

seqlib's own C++ primitives (:mod:`seqlib.native`) call ``cblas_sgemm`` by name and
get the shim's, loaded for them with ``RTLD_GLOBAL`` when they are first built
(:func:`load_shim`), whether MLX is routed or not.  Nothing else is exported, so
PyTorch (or NumPy) in the same process keeps its own BLAS and its speed.  On macOS
nothing is done: MLX uses Accelerate.  If routing cannot be done (no C compiler, no
scipy-openblas32, or a ``libmlx.so`` whose slots cannot be found) a one-line
:class:`BlasRoutingWarning` says so and MLX keeps its own BLAS.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from seqlib import _build

ENV_VAR = "SEQLIB_BLAS"
SHIM_SOURCE = _build.SHIM_SOURCE
ROUTED_NAMES = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")


class BlasRoutingWarning(RuntimeWarning):
    """MLX's matmuls could not be routed to OpenBLAS and will be slow."""


@dataclass(frozen=True)
class BlasStatus:
    routed: bool  # True when MLX's GEMM calls reach OpenBLAS through the shim
    reason: str  # one sentence on why (or why not)
    shim_path: str | None = None
    kernels: str | None = None  # the OpenBLAS kernels that run (its core name, "SkylakeX", "Haswell"), when routed


status = BlasStatus(routed=False, reason="not routed: call seqlib.route_mlx_blas() (or set SEQLIB_BLAS=1)")
_shim: ctypes.CDLL | None = None
_openblas: ctypes.CDLL | None = None  # the OpenBLAS library load_shim loaded


def _openblas_dir() -> str:
    import scipy_openblas32  # the OpenBLAS wheel NumPy and SciPy build against

    return scipy_openblas32.get_lib_dir()


def _build_shim(openblas_dir: str) -> Path:
    """The shim built at install (where its key matches), else compiled once into the cache."""
    key = _build.shim_key(openblas_dir)
    packaged = _build.prebuilt(_build.PACKAGE_DIR / _build.SHIM_NAME, key)
    if packaged is not None:
        return packaged
    target = _build.cache_dir() / f"blas_shim-{_build.key_of(key, *_build.find_compiler('c'))}.so"
    return _build.build_once(target, lambda partial: _build.shim_command(openblas_dir, partial))


#: How long OpenBLAS's idle workers spin after a threaded call before they sleep, as a power of two of
#: cycles (OpenBLAS's own default is 2**28, about a tenth of a second).  seqlib.native's time loops start
#: right after MLX's input product and share their steps among threads of their own: a worker still
#: spinning holds a core they need, and the team then waits at every step for the thread that shares it
#: (whole scheduler slices, not just the spin).  On a 2-core Sapphire Rapids, one LSTM layer's forward at
#: (T, B, H) = (32, 64, 128), 60 runs: median 16.9 ms spinning 2**28, 5.4 at 2**20, 3.7 at 2**16 to 2**8;
#: python -m seqlib.bench's training step at H = 128, 2**20 -> 2**14: 49-52 -> 43-45 ms (two alternated
#: processes each), the large-batch LSTM forwards 5-10% faster, nothing slower.  2**14 cycles (a few
#: microseconds) still carries the workers across MLX's back-to-back products.
OPENBLAS_WORKER_SPIN = 14


@contextmanager
def _short_worker_spin():
    """OPENBLAS_THREAD_TIMEOUT set to :data:`OPENBLAS_WORKER_SPIN` while the OpenBLAS library loads (it reads
    the variable once, then), unless the user set it; the environment is as it was afterwards.  Where the
    library was loaded before (``import scipy_openblas32`` elsewhere) it keeps the spin it was loaded with."""
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        yield
        return
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(OPENBLAS_WORKER_SPIN)
    try:
        yield
    finally:
        del os.environ["OPENBLAS_THREAD_TIMEOUT"]


def load_shim() -> ctypes.CDLL:
    """The shim, built if need be and loaded with ``RTLD_GLOBAL`` (so that a library loaded after it, such as
    seqlib's C++ primitives, binds ``cblas_sgemm`` to it), without touching MLX.  Raises ImportError,
    OSError, :class:`seqlib._build.CompilerNotFoundError` or ``subprocess.CalledProcessError`` when it
    cannot be built or loaded."""
    global _shim, _openblas
    if _shim is None:
        with _short_worker_spin():  # importing scipy_openblas32 loads its library
            openblas_dir = _openblas_dir()
            # Loaded first, by path: a shim built at install found it through a build folder that is gone.
            _openblas = ctypes.CDLL(os.path.join(openblas_dir, "libscipy_openblas.so"), mode=ctypes.RTLD_GLOBAL)
        _shim = ctypes.CDLL(str(_build_shim(openblas_dir)), mode=ctypes.RTLD_GLOBAL)
    return _shim


def _openblas_kernels() -> str | None:
    """The name of the loaded OpenBLAS's kernels for this CPU (``openblas_get_corename``), if it says; after
    :func:`load_shim`."""
    corename = getattr(_openblas, "scipy_openblas_get_corename", None)
    if corename is None:
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()


def _mlx_calls_the_shim(shim: ctypes.CDLL) -> bool:
    """Run one small MLX matmul and see whether it went through the shim."""
    import mlx.core as mx

    counter = shim.seqlib_blas_shim_calls
    counter.restype = ctypes.c_int64
    before = counter()
    a = mx.ones((8, 8), dtype=mx.float32, stream=mx.cpu)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    return counter() > before


def _turned_off() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in {"0", "off", "false", "no"}


def route_mlx_blas() -> BlasStatus:
    """Send MLX's float32, float64 and complex64 matmuls to OpenBLAS on Linux (20-30x faster than the
    reference BLAS MLX's Linux wheel ships), once per process; return and remember the outcome.

    Rebinds the three GEMM slots of the loaded ``libmlx.so`` to seqlib's shim (built on the first call,
    about a second, then cached).  PyTorch and NumPy in the process keep their own BLAS.  Does nothing
    on macOS (MLX uses Accelerate) or with ``SEQLIB_BLAS=0``; warns once (:class:`BlasRoutingWarning`)
    and leaves MLX as it was where it cannot be done.  Check with :func:`seqlib.blas_status`.
    """
    global status
    if status.routed:
        return status
    if sys.platform != "linux":
        status = BlasStatus(False, "not Linux: MLX already uses an optimised BLAS")
        return status
    if _turned_off():
        status = BlasStatus(False, f"turned off by {ENV_VAR}={os.environ[ENV_VAR]}")
        return status
    try:
        shim = load_shim()
    except (ImportError, OSError, _build.CompilerNotFoundError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        reason = f"could not build or load the OpenBLAS shim ({error} {detail.decode()[:200]})"
        return _give_up(reason.strip())
    import mlx.core  # noqa: F401  (seqlib imports it anyway: its slots are bound and must be rebound)

    try:
        _rebind_loaded_mlx(shim)
    except (OSError, ValueError) as error:
        return _give_up(f"the loaded libmlx.so's BLAS could not be rebound ({error})")
    if _mlx_calls_the_shim(shim):
        status = BlasStatus(True, "MLX's cblas_*gemm calls go to OpenBLAS (rebound by seqlib.route_mlx_blas)",
                            str(shim._name), _openblas_kernels())  # fmt: skip
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
