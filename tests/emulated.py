"""The test suite's switch to seqlib's Metal path: the emulation on Linux, real Metal on a Mac.

On a Mac, SEQLIB_TEST_REAL_METAL=1 runs the same kernel tests on the GPU
(.github/workflows/metal.yml does); elsewhere they run through seqlib.emulation.
:func:`launch_count` counts kernel launches on either.
"""

from __future__ import annotations

import contextlib
import os

import mlx.core as mx

from seqlib import emulation, kernels

REAL_METAL = os.environ.get("SEQLIB_TEST_REAL_METAL") == "1"

_real_launches = 0
_mlx_metal_kernel = mx.fast.metal_kernel


def _counting_metal_kernel(**arguments):
    """mx.fast.metal_kernel, with every launch of the kernel counted (for launch_count on real Metal)."""
    kernel = _mlx_metal_kernel(**arguments)

    def launch(**call):
        global _real_launches
        _real_launches += 1
        return kernel(**call)

    return launch


def launch_count() -> int:
    """How many Metal kernels have been launched so far (emulated, or on the GPU inside metal_backend)."""
    return emulation.launch_count() + _real_launches


@contextlib.contextmanager
def metal_backend(order: str = "forward", pad_grid: bool = False, seed: int = 0):
    """Run the block on seqlib's Metal path: emulated (with this thread order and grid padding) or real."""
    if REAL_METAL:
        mx.fast.metal_kernel = _counting_metal_kernel
        try:
            with kernels.use_backend("metal"):
                yield
        finally:
            mx.fast.metal_kernel = _mlx_metal_kernel
        return
    with emulation.options(order=order, seed=seed, pad_grid=pad_grid), kernels.use_backend("emulate"):
        yield
