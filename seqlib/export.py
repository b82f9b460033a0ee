"""Exporting a program that uses seqlib: ``mx.export_function`` with seqlib on MLX's own primitives.

``mx.export_function`` serialises a traced graph, and it can serialise only MLX's built-in
primitives: a custom function (``mx.custom_function``, which seqlib uses for its hand-written
backward passes), a compiled inner function, an extension's primitive (seqlib's C++ CPU
primitives) or a Metal kernel all fail with "Unable to serialize primitive".  MLX gives a
library no way to tell that it is being exported, so seqlib offers one switch:
:func:`export_function` runs the export with every seqlib module on the ``"plain"`` path of
:mod:`seqlib.dispatch` (MLX's built-in ops only, the same numbers within float32 rounding:
``mx.tanh`` instead of seqlib's rational tanh).  The file it writes needs nothing of seqlib:
``mx.import_function`` loads and runs it anywhere MLX runs.

Outside an export the same switch is ``seqlib.kernels.use_backend("plain")`` (or
``SEQLIB_BACKEND=plain``).  In the plain path an index outside a table, known only inside
the graph, reads a row of NaN instead of raising (see :mod:`seqlib.functional`).
"""

from __future__ import annotations

import mlx.core as mx

from seqlib.kernels.runtime import use_backend

__all__ = ["export_function"]


def export_function(file, fun, *args, shapeless: bool = False, **kwargs) -> None:
    """``mx.export_function(file, fun, *args, shapeless=shapeless, **kwargs)`` with seqlib's modules on MLX's
    built-in primitives, so that the graph can be serialised.  Load it with ``mx.import_function(file)``.

    ``fun`` may be any function of MLX arrays that calls seqlib's modules (a model's forward, a
    training step that returns new parameters); ``args`` and ``kwargs`` are example inputs, as for
    ``mx.export_function``.
    """
    with use_backend("plain"):
        mx.export_function(file, fun, *args, shapeless=shapeless, **kwargs)
