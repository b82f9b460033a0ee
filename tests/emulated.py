"""A Metal emulation owned by the test suite: seqlib's kernels compiled as C++ and run on the CPU.

- :mod:`.codegen`: MLX's exact signature text around a kernel body;
- :mod:`.runner`: ``metal_kernel``, a drop-in for ``mx.fast.metal_kernel``;
- :mod:`.lint`: what Metal rejects but g++ would accept;
- ``include/metal_emulation.h``: the MSL names and the fiber scheduler.

:func:`metal_backend` points seqlib at the emulation, so the modules take
their Metal path on Linux.
"""

from __future__ import annotations

import contextlib
import os

from seqlib import kernels

from . import runner

# On a Mac, SEQLIB_TEST_REAL_METAL=1 runs the same kernel tests on the GPU instead
# (.github/workflows/metal.yml does): metal_backend then only counts launches.
REAL_METAL = os.environ.get("SEQLIB_TEST_REAL_METAL") == "1"


def _counting_metal_kernel(**arguments):
    kernel = kernels.mx.fast.metal_kernel(**arguments)

    def launch(**call):
        runner.launch_count += 1
        return kernel(**call)

    return launch


@contextlib.contextmanager
def metal_backend(order: str = "forward", pad_grid: bool = False, seed: int = 0):
    """Inside the block seqlib believes Metal is available and runs every kernel in the emulation
    (with this thread order and grid padding), or on the GPU where REAL_METAL is set."""
    saved_factory, saved_available = kernels._factory, kernels.metal_available
    if REAL_METAL:
        kernels._factory = _counting_metal_kernel
    else:
        kernels._factory = runner.metal_kernel
        kernels.metal_available = lambda: True
    try:
        with runner.emulation(order, seed, pad_grid), kernels.use_backend("metal"):
            yield
    finally:
        kernels._factory, kernels.metal_available = saved_factory, saved_available
