"""What seqlib asks of MLX's lazy graph: is an array traced, and are its values already there.

MLX builds a graph and evaluates it later; its transformations (``mx.grad``, ``mx.vjp``,
``mx.vmap``, ``mx.compile``, ``mx.export_function``) trace arrays that have no values at
all.  A library inside such a program may read values on the host only where they already
exist: it must never force an evaluation (``mx.eval``, ``.item()``, a NumPy conversion of a
lazy array) inside a forward, which stalls a lazy program and fails under every
transformation.  Two questions decide it, both answered from the graph without evaluating:

- :func:`is_traced`: does a transformation trace any of these arrays?  (Then a gradient may
  be taken through the result, and nothing about their values is known.)
- :func:`host_values`: the values of an index array, when they already exist (NumPy, or an
  evaluated array that nothing traces); else None, and the caller checks in the graph, with
  the extension's checking primitives where :func:`graph_checks` returns it.

Both read MLX's C++ ``array::is_tracer()`` and ``array::is_available()`` through seqlib's
extension (:func:`seqlib.native.module`, loaded even where ``SEQLIB_NATIVE=0`` turns its
primitives off).  Where the extension cannot be loaded (no compiler; not Linux), a compiled
probe tells traced calls from plain ones, and an untraced MLX array counts as evaluated:
reading it then evaluates it, the one place seqlib still synchronises, and only there.
"""

from __future__ import annotations

import platform
import shutil

import mlx.core as mx
import numpy as np

from seqlib import native

__all__ = ["graph_checks", "host_values", "is_traced"]


_compiled_traces = 0


def _count_traces(*arrays):
    global _compiled_traces
    _compiled_traces += 1
    return arrays[0]


_probe = None if platform.system() == "Linux" and shutil.which("g++") is None else mx.compile(
    _count_traces, shapeless=True)  # fmt: skip


def _probe_traced(arrays) -> bool:
    """The fallback without the extension: a shapeless compiled probe is traced again on every call
    while one of its inputs is a tracer, and otherwise only on the first call with new dtypes or
    numbers of dimensions (then a second call tells).  True where ``mx.compile`` cannot run."""
    if _probe is None:
        return True
    for _ in range(2):
        before = _compiled_traces
        _probe(*arrays)
        if _compiled_traces == before:
            return False
    return True


def is_traced(*arrays: mx.array | None) -> bool:
    """Whether any of ``arrays`` is being traced by an MLX transformation (``mx.grad``, ``mx.vjp``,
    ``mx.vmap``, ``mx.compile``, ``mx.export_function``), so that a gradient may be taken through
    what is computed from it and its values are not known.  None entries (an optional argument
    left out) are skipped.  Evaluates nothing."""
    arrays = [array for array in arrays if array is not None]
    extension = native.module()
    if extension is None:
        return _probe_traced(arrays)
    return any(map(extension.is_tracer, arrays))  # a streamed step asks for 7-11 arrays: 0.4 us, 0.8 with a generator


def host_values(array) -> np.ndarray | None:
    """``array``'s values as NumPy where reading them forces no evaluation: a NumPy array as it is, an
    MLX array that is evaluated and not traced; None for a lazy or traced one (check it in the graph)."""
    if isinstance(array, np.ndarray):
        return array
    extension = native.module()
    if extension is None:
        return None if _probe_traced((array,)) else np.asarray(array)
    if extension.is_tracer(array) or not extension.is_available(array):
        return None
    return np.asarray(array)


def graph_checks(path: str):
    """seqlib's extension where its checking primitives (``checked_indices``, ``checked_bounds``) may run in
    the graph of a call on ``path`` (a name from :data:`seqlib.dispatch.PATHS`): on MLX's CPU device and
    not on the ``"plain"`` path, whose graph must hold MLX's own primitives only; else None."""
    extension = native.module()
    return extension if extension is not None and path != "plain" and mx.default_device() == mx.cpu else None
