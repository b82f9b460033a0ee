"""Metal on the CPU: kernels written for ``mx.fast.metal_kernel`` compiled as C++ and run on any machine.

:func:`metal_kernel` takes exactly ``mx.fast.metal_kernel``'s arguments and
returns a kernel called exactly like MLX's.  It generates the source MLX would
compile for the call (``verbose=True`` prints it as MLX does), compiles it with
the host C++ compiler against a small header that defines the Metal names
(``include/metal_emulation.h``), and runs every thread of the grid on the CPU:
the threads of a threadgroup as cooperative fibers, so ``threadgroup_barrier``
and SIMD-group collectives (``simd_sum``, ``simd_shuffle_down``, ...) really
synchronise.  ``seqlib.kernels.use_backend("emulate")`` (or
``SEQLIB_BACKEND=emulate``) sends all of seqlib's modules through it::

    import mlx.core as mx
    from seqlib import emulation

    kernel = emulation.metal_kernel(
        name="double", input_names=["a"], output_names=["out"],
        source="uint i = thread_position_in_grid.x; out[i] = 2 * a[i];")
    a = mx.arange(8, dtype=mx.float32)
    with emulation.options(order="random"), emulation.record() as launches:
        (out,) = kernel(inputs=[a], output_shapes=[a.shape], output_dtypes=[a.dtype],
                        grid=(8, 1, 1), threadgroup=(4, 1, 1))
    launches[0].threadgroups  # 2

What it is for: checking a kernel's logic where there is no Mac, and seeing
what a kernel does (:func:`record` counts barriers, atomics and SIMD
collectives per thread and tells which thread wrote each output element).
:func:`options` runs the threads forward, in reverse or in random order, fills
outputs with NaN and puts guard zones around every buffer, so a missing
barrier, an unwritten element or an out-of-bounds write shows.  :func:`lint`
flags what the Metal compiler rejects but a C++ compiler accepts.

What it is not: a measure of speed, of fast-math precision, of register or
memory pressure, or of GPU memory ordering between threadgroups.  Run on a
real Mac before trusting a kernel.

Sizes that are practical (measured on one core of a shared x86-64 Linux
server; take them as orders of magnitude):

- compiling: 0.5 to 2 s per new kernel text (each distinct kernel, template
  value, dtype, or input of fewer than 8 elements, which MLX passes in
  ``constant`` memory); cached on disk afterwards (``$SEQLIB_EMULATION_CACHE``);
- a launch: about 0.1-0.3 ms of fixed cost (copying arrays in and out);
- per emulated thread, for a kernel without barriers or SIMD collectives
  (the threads run as plain calls): 20-100 ns, so a million threads take
  about 25 ms;
- for a kernel with them (each thread a fiber): about 0.2 us per thread,
  plus about 0.1 us per thread per ``threadgroup_barrier`` and 0.2 us per
  thread per SIMD collective (``simd_sum``...).

A whole-sequence LSTM kernel (``lstm_sequence.metal``: one 256-thread group
per batch row, looping over T steps with a barrier and ``4 * ceil(H / 8)``
``simd_sum`` calls per thread per step) takes about 4 us per thread per step
at H = 32: 0.2 s for T = 50, B = 4; it grows linearly in T, B and H, so keep
to T, B and H of tens when emulating it.  ``record(writers=True)`` adds a
comparison of every output after each thread's slice of execution: cheap for
outputs of a few thousand elements, quadratic beyond.

Compiler: ``$CXX`` if set (it may include flags, e.g. ``"ccache g++"``), else
``g++`` on Linux or ``clang++`` on macOS, then the other, then ``c++``; if none
is found, :class:`CompilerNotFoundError` says how to install one.  The
emulation uses POSIX ``ucontext`` for its fibers (Linux and macOS).
"""

from seqlib.emulation.lint import lint
from seqlib.emulation.compiler import CompilerNotFoundError, EmulationError
from seqlib.emulation.recording import Launch, launch_count, record
from seqlib.emulation.runner import EmulatedKernel, metal_kernel, options

__all__ = [
    "CompilerNotFoundError",
    "EmulatedKernel",
    "EmulationError",
    "Launch",
    "launch_count",
    "lint",
    "metal_kernel",
    "options",
    "record",
]
