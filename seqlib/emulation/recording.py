"""What an emulated launch did: :func:`record`, :class:`Launch` and the counters the C++ side fills.

The header's launcher counts barriers, atomics and SIMD collectives, in total
and per thread, into an :class:`Instruments` struct; with ``record(writers=True)``
it also compares every output with a shadow copy after each slice of a thread's
execution and notes which thread changed each element.  :class:`ThreadCounters`
holds the NumPy arrays it writes into; :class:`Launch` is what a reader gets.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

__all__ = ["Instruments", "Launch", "ThreadCounters", "count_launch", "launch_count", "open_recorders", "record"]

SIMD_WIDTH = 32


class Instruments(ctypes.Structure):
    """Mirror of ``emu::Instruments`` in metal_emulation.h (same fields, same order)."""

    _fields_ = [
        ("barriers", ctypes.c_uint64),
        ("barrier_waits", ctypes.c_uint64),
        ("atomics", ctypes.c_uint64),
        ("simd_collectives", ctypes.c_uint64),
        ("thread_barriers", ctypes.c_void_p),
        ("thread_atomics", ctypes.c_void_p),
        ("thread_simd", ctypes.c_void_p),
        ("thread_writes", ctypes.c_void_p),
        ("output_count", ctypes.c_int32),
        ("outputs", ctypes.POINTER(ctypes.c_void_p)),
        ("shadows", ctypes.POINTER(ctypes.c_void_p)),
        ("output_bytes", ctypes.POINTER(ctypes.c_uint64)),
        ("element_bytes", ctypes.POINTER(ctypes.c_uint32)),
        ("writers", ctypes.POINTER(ctypes.c_void_p)),
    ]


@dataclass(frozen=True, eq=False)
class Launch:
    """What one emulated kernel call did, as recorded by :func:`record`.

    The call (what was passed to :func:`metal_kernel` and to the kernel):
    ``name``, ``input_names``, ``output_names``, ``source``, ``header``,
    ``atomic_outputs``, ``input_shapes``, ``input_dtypes``, ``output_shapes``,
    ``output_dtypes``, ``template`` (None or the list of ``(name, value)``),
    ``init_value``; ``text`` is the source MLX generates for it (what
    ``verbose=True`` prints).

    The launch: ``grid`` (threads along x, y, z: the call's grid, rounded up to
    whole threadgroups under ``options(pad_grid=True)``), ``threadgroup`` (as
    MLX clamps it, ``min(threadgroup, grid)`` per axis), ``threadgroups`` (how
    many groups ran) and ``threads`` (how many threads ran, ``gx * gy * gz``).

    Totals: ``barriers`` (barrier releases: rendezvous of a whole threadgroup
    at a ``threadgroup_barrier``, summed over groups), ``barrier_waits``
    (arrivals: one per thread per barrier, so ``barriers * threads per group``
    when every group is full), ``atomics`` (atomic operations executed, on
    device or threadgroup memory) and ``simd_collectives`` (``simd_sum``,
    ``simd_shuffle``... completed: one per SIMD group per call).

    Per thread, arrays of shape ``(gz, gy, gx)`` indexed ``[z, y, x]`` by the
    thread's position in the grid (uint32): ``thread_barriers`` (barriers it
    reached), ``thread_atomics`` (atomic operations it executed),
    ``thread_simd_collectives`` (collectives it took part in) and, with
    ``record(writers=True)`` only, ``thread_writes`` (output elements it changed).

    ``writers`` (``record(writers=True)`` only, else None): for each output
    name, an int64 array of the output's shape holding the linear grid index
    ``x + gx * (y + gy * z)`` of the thread that last *changed* the element
    (-1: no thread did; writing the value already there is invisible).
    :meth:`writer_threadgroup`, :meth:`writer_simdgroup` and
    :meth:`writer_lane` turn it into the writer's threadgroup, SIMD group and lane.
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    atomic_outputs: bool
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[mx.Dtype, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[mx.Dtype, ...]
    template: list | None
    init_value: float | None
    text: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    threadgroups: int
    threads: int
    barriers: int
    barrier_waits: int
    atomics: int
    simd_collectives: int
    thread_barriers: np.ndarray
    thread_atomics: np.ndarray
    thread_simd_collectives: np.ndarray
    thread_writes: np.ndarray | None
    writers: dict[str, np.ndarray] | None

    def _writer_positions(self, output: str):
        """For each element of ``output``: whether some thread wrote it, and its writer's threadgroup position,
        position inside that group and the group's actual size (edge groups are partial), each ``(x, y, z)``."""
        if self.writers is None:
            raise ValueError("writers were not recorded: use seqlib.emulation.record(writers=True)")
        if output not in self.writers:
            raise ValueError(f"output: expected one of {list(self.writers)}, got {output!r}")
        writer = self.writers[output]
        written = writer >= 0
        grid = [max(size, 1) for size in self.grid]
        group = [max(size, 1) for size in self.threadgroup]
        index = np.where(written, writer, 0)
        position = (index % grid[0], index // grid[0] % grid[1], index // (grid[0] * grid[1]))
        group_position = [p // g for p, g in zip(position, group, strict=True)]
        inside = [p - q * g for p, q, g in zip(position, group_position, group, strict=True)]
        actual = [np.minimum(g, n - q * g) for q, g, n in zip(group_position, group, grid, strict=True)]
        return written, group_position, inside, actual

    def writer_threadgroup(self, output: str) -> np.ndarray:
        """For each element of ``output``: the linear index ``gx + ngx * (gy + ngy * gz)`` of the threadgroup
        (at position ``(gx, gy, gz)`` in a grid of ``ngx * ngy * ngz`` groups) whose thread last changed it; -1
        where none did."""
        written, group_position, _, _ = self._writer_positions(output)
        groups = [-(-max(n, 1) // max(g, 1)) for n, g in zip(self.grid, self.threadgroup, strict=True)]
        linear = group_position[0] + groups[0] * (group_position[1] + groups[1] * group_position[2])
        return np.where(written, linear, -1)

    def _writer_index_in_threadgroup(self, output: str):
        written, _, inside, actual = self._writer_positions(output)
        return written, inside[0] + actual[0] * (inside[1] + actual[1] * inside[2])

    def writer_simdgroup(self, output: str) -> np.ndarray:
        """For each element of ``output``: the writer's ``simdgroup_index_in_threadgroup``
        (``thread_index_in_threadgroup // 32``); -1 where no thread changed it."""
        written, index = self._writer_index_in_threadgroup(output)
        return np.where(written, index // SIMD_WIDTH, -1)

    def writer_lane(self, output: str) -> np.ndarray:
        """For each element of ``output``: the writer's ``thread_index_in_simdgroup``
        (``thread_index_in_threadgroup % 32``); -1 where no thread changed it."""
        written, index = self._writer_index_in_threadgroup(output)
        return np.where(written, index % SIMD_WIDTH, -1)


_recorders: list[tuple[list[Launch], bool]] = []  # the open record() blocks, innermost last
_launches = 0


def open_recorders() -> list[tuple[list[Launch], bool]]:
    """The record() blocks open now, innermost last: (the list receiving launches, writers asked for)."""
    return list(_recorders)


def count_launch() -> None:
    """Count one launch for :func:`launch_count` (the runner calls it for every launch, failed or not)."""
    global _launches
    _launches += 1


@contextlib.contextmanager
def record(writers: bool = False) -> Iterator[list[Launch]]:
    """Record every emulated kernel call made inside the block.

    Yields a list that receives one :class:`Launch` per call, in call order:
    the call's arguments and generated text, the launch geometry, counts of
    barriers, atomics and SIMD collectives (in total and per thread).

    Args:
        writers: also find out which thread last changed each output element
            (``Launch.writers``, ``Launch.thread_writes``).  This compares every
            output with a copy after each slice of each thread's execution, so
            it costs ``O(threads * output bytes)``: keep the outputs small.

    Example::

        with seqlib.emulation.record(writers=True) as launches:
            out = kernel(inputs=[a], ...)[0]
        launches[0].barriers, launches[0].writer_lane("out")
    """
    if not isinstance(writers, bool):
        raise TypeError(f"writers: expected a bool, got {type(writers).__name__}")
    entry: tuple[list[Launch], bool] = ([], writers)
    _recorders.append(entry)
    try:
        yield entry[0]
    finally:
        _recorders[:] = [other for other in _recorders if other is not entry]


def launch_count() -> int:
    """How many kernels the emulation has launched in this process (failed launches included)."""
    return _launches


class ThreadCounters:
    """The per-thread counters and writer arrays handed to one launch."""

    def __init__(self, grid: list[int], outputs: list, output_shapes, writers: bool):
        """grid: threads along x, y, z; outputs: the runner's guarded output buffers (``values``, ``pointer``)."""
        shape = (grid[2], grid[1], grid[0])
        self.thread_barriers = np.zeros(shape, np.uint32)
        self.thread_atomics = np.zeros(shape, np.uint32)
        self.thread_simd = np.zeros(shape, np.uint32)
        self.thread_writes = np.zeros(shape, np.uint32) if writers else None
        self.outputs = outputs if writers else []
        self.shadows = [buffer.values.copy() for buffer in self.outputs]
        self.writers = [np.full(buffer.size, -1, np.int64) for buffer in self.outputs]
        self.output_shapes = output_shapes

    def fill(self, instruments: Instruments) -> list:
        """Point ``instruments`` at these arrays; returns the ctypes arrays that must outlive the launch."""
        instruments.thread_barriers = self.thread_barriers.ctypes.data
        instruments.thread_atomics = self.thread_atomics.ctypes.data
        instruments.thread_simd = self.thread_simd.ctypes.data
        if self.thread_writes is None:
            return []
        count = len(self.outputs)
        held = [
            (ctypes.c_void_p * count)(*[buffer.pointer for buffer in self.outputs]),
            (ctypes.c_void_p * count)(*[shadow.ctypes.data for shadow in self.shadows]),
            (ctypes.c_uint64 * count)(*[buffer.values.nbytes for buffer in self.outputs]),
            (ctypes.c_uint32 * count)(*[buffer.values.itemsize for buffer in self.outputs]),
            (ctypes.c_void_p * count)(*[writer.ctypes.data for writer in self.writers]),
        ]
        instruments.thread_writes = self.thread_writes.ctypes.data
        instruments.output_count = count
        instruments.outputs = ctypes.cast(held[0], ctypes.POINTER(ctypes.c_void_p))
        instruments.shadows = ctypes.cast(held[1], ctypes.POINTER(ctypes.c_void_p))
        instruments.output_bytes = ctypes.cast(held[2], ctypes.POINTER(ctypes.c_uint64))
        instruments.element_bytes = ctypes.cast(held[3], ctypes.POINTER(ctypes.c_uint32))
        instruments.writers = ctypes.cast(held[4], ctypes.POINTER(ctypes.c_void_p))
        return held

    def writer_arrays(self, output_names) -> dict[str, np.ndarray] | None:
        if self.thread_writes is None:
            return None
        return {
            name: writer.reshape(shape)
            for name, writer, shape in zip(output_names, self.writers, self.output_shapes, strict=True)
        }
