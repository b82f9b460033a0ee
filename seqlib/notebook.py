"""Helpers for the chapter notebooks (need IPython; import on demand).

``show_source`` is how every chapter shows the code it discusses: straight from
the installed library, so the page shows exactly what the tests test.

``show_kernel`` shows a Metal kernel as MLX compiles it: the body from
``metal_kernels/`` inside the signature MLX generates for it.

``below`` is how every chapter prints a comparison with a reference.  The digits
of a float32 rounding error depend on the machine (BLAS kernels, vector width,
thread count, Metal or CPU), so a chapter that printed ``4.47e-08`` would show
``0.0`` on the next CPU.  A bound is the claim the text makes, and it holds on
every machine; a broken computation still shows, because then the error itself
is printed.
"""

from __future__ import annotations

import inspect

import numpy as np
from IPython.display import Code

__all__ = ["below", "show_kernel", "show_source"]


def show_source(obj) -> Code:
    """Syntax-highlighted source of a seqlib function, class or method."""
    return Code(inspect.getsource(obj), language="python")


def show_kernel(name: str, dtype=None, header: bool = True, **template) -> Code:
    """Syntax-highlighted source of seqlib's Metal kernel ``name`` with the signature MLX generates for it.

    ``dtype`` (default float32) and ``template`` values as :func:`seqlib.kernels.generated_source` takes them.
    ``header=False`` leaves out the shared header ``seqlib_math.h`` (the same for every kernel, so a
    chapter shows it once) and puts a one-line comment in its place.
    """
    import mlx.core as mx

    from seqlib.kernels import HEADER_NAME, generated_source, kernel_header

    text = generated_source(name, mx.float32 if dtype is None else dtype, **template)
    if not header:
        text = text.replace(kernel_header(), f"// ... {HEADER_NAME} (the shared helpers; shown once above) ...\n", 1)
    return Code(text, language="cpp")


def below(error, bound: float) -> str:
    """``"< 1e-06"`` when ``max |error|`` is below ``bound``, else the error itself, flagged.

    ``error`` is a number or an array of differences (MLX, NumPy or anything
    ``np.asarray`` takes); NaN counts as above every bound.

    >>> below(3e-8, 1e-6)
    '< 1e-06'
    >>> below([0.0, -2e-3], 1e-6)
    '= 2.0e-03, ABOVE the bound 1e-06'
    """
    worst = float(np.max(np.abs(np.asarray(error, dtype=np.float64)), initial=0.0))
    if worst < bound:
        return f"< {bound:.0e}"
    return f"= {worst:.1e}, ABOVE the bound {bound:.0e}"
