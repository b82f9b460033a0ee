"""This machine's own limits, measured: the rate of a large float32 matmul and of a large copy.

A benchmark time says little until it stands next to what the machine could do.  The two
numbers here are the machine's roofline, measured rather than taken from a data sheet:

- ``sgemm_flops``: FLOP/s of one large square float32 product through MLX (OpenBLAS behind
  seqlib's routing on Linux, Accelerate on a Mac), with the threads BLAS is set to use.  No
  recurrent layer can turn its matmul FLOPs into time faster than this.
- ``bandwidth``: bytes/s (read plus write) of copying a buffer far larger than the caches with
  NumPy, split over every core this process may use.  A step at batch 1 reads every weight
  once, so its time is bound by bytes over this.

:meth:`Machine.limit_seconds` is the roofline's time for a workload: the longer of its FLOPs
over the matmul rate and its bytes over the bandwidth.  The harness prints it beside each case
(the "limit ms" column) and each implementation's time over it ("x limit").

A shared machine's speed drifts while a suite runs (another tenant's load comes and goes), so a
rate measured once at the start can flatter or wrong the cases timed minutes later.  A measured
machine keeps its product (``matmul``); the harness times it again with every repeat of each case,
interleaved with the implementations, and takes that case's matmul rate from the fastest of those
runs (:func:`seqlib.bench.run_cases`).  The bandwidth stays the one measured at the start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Machine", "measure_machine"]


@dataclass(frozen=True)
class Machine:
    """A machine's measured matmul rate (FLOP/s) and copy bandwidth (bytes/s); ``matmul`` runs the measured product
    once more (None where the rates were given, not measured)."""

    sgemm_flops: float
    bandwidth: float
    sgemm_size: int
    copy_bytes: int
    threads: int
    matmul: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def at_matmul_seconds(self, seconds: float) -> Machine:
        """This machine with the matmul rate of one product of ``sgemm_size`` that took ``seconds``."""
        return replace(self, sgemm_flops=2 * self.sgemm_size**3 / seconds)

    def limit_seconds(self, flops: float, bytes_moved: float) -> float:
        """The roofline's time: ``max(flops / sgemm_flops, bytes_moved / bandwidth)``."""
        return max(flops / self.sgemm_flops, bytes_moved / self.bandwidth)

    def describe(self) -> str:
        """One line for a benchmark's header: both rates and how they were measured."""
        return (f"this machine's limits: float32 matmul {self.sgemm_flops / 1e9:.0f} GFLOP/s "
                f"({self.sgemm_size}^3 through MLX), copy {self.bandwidth / 1e9:.1f} GB/s "
                f"({self.copy_bytes >> 20} MB, read + write, {self.threads} threads)")  # fmt: skip


def _fastest(function, repeats: int) -> float:
    function()  # warm up: first-touch page faults, BLAS's buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: a limit is a best case


def measure_machine(sgemm_size: int = 2048, copy_megabytes: int = 256, repeats: int = 5) -> Machine:
    """Measure :class:`Machine`'s two rates here (a second or two)."""
    import mlx.core as mx

    a = mx.random.normal((sgemm_size, sgemm_size))
    b = mx.random.normal((sgemm_size, sgemm_size))
    mx.eval(a, b)
    def matmul():
        mx.eval(a @ b)

    matmul_seconds = _fastest(matmul, repeats)
    source = np.ones(copy_megabytes << 18, dtype=np.float32)  # copy_megabytes MB
    target = np.empty_like(source)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # one contiguous slice of both buffers per thread (np.array_split of the buffers themselves: views, no copy)
    parts = list(zip(np.array_split(target, threads), np.array_split(source, threads), strict=True))
    with ThreadPoolExecutor(threads) as pool:  # np.copyto releases the GIL: the parts copy at once

        def copy_all():
            list(pool.map(lambda part: np.copyto(*part), parts))

        copy_seconds = _fastest(copy_all, repeats)
    return Machine(sgemm_flops=2 * sgemm_size**3 / matmul_seconds, bandwidth=2 * source.nbytes / copy_seconds,
                   sgemm_size=sgemm_size, copy_bytes=source.nbytes, threads=threads, matmul=matmul)  # fmt: skip
