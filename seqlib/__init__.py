"""seqlib: PyTorch-compatible embeddings and recurrent networks for MLX.

The library the book *Embeddings and Recurrent Networks in MLX* builds chapter by
chapter.  Importing it has no side effect beyond Python imports: it compiles nothing and
changes nothing in MLX.  On Linux, :func:`route_mlx_blas` sends MLX's own matmuls to
OpenBLAS when a program asks for it (the book does, in every chapter's first cell), and
``SEQLIB_BLAS=1`` makes the import ask (see :mod:`seqlib._blas`).
"""

import os as _os

from seqlib import (
    activations,
    data,
    dispatch,
    distributed,
    emulation,
    export,
    functional,
    graph,
    interop,
    kernels,
    losses,
    native,
    nn,
    optim,
    pointwise,
    reference,
    scan,
    sparse,
)
from seqlib._blas import BlasRoutingWarning, BlasStatus, route_mlx_blas
from seqlib.export import export_function
from seqlib.interop import from_torch
from seqlib.nn import Embedding, EmbeddingBag
from seqlib.sparse import SparseGradient

__version__ = "0.1.0"


def blas_status() -> BlasStatus:
    """How MLX's BLAS is set up in this process (routed to OpenBLAS or not, and why)."""
    from seqlib import _blas

    return _blas.status


if _os.environ.get("SEQLIB_BLAS", "").strip().lower() in {"1", "on", "true", "yes"}:
    route_mlx_blas()  # asked for by the environment, for programs that cannot call it themselves

__all__ = [
    "BlasRoutingWarning",
    "BlasStatus",
    "Embedding",
    "EmbeddingBag",
    "SparseGradient",
    "__version__",
    "activations",
    "blas_status",
    "data",
    "dispatch",
    "distributed",
    "emulation",
    "export",
    "export_function",
    "from_torch",
    "functional",
    "graph",
    "interop",
    "kernels",
    "losses",
    "native",
    "nn",
    "optim",
    "pointwise",
    "reference",
    "route_mlx_blas",
    "scan",
    "sparse",
]
