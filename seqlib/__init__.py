"""seqlib: PyTorch-compatible embeddings and recurrent networks for MLX.

The library the book *Embeddings and Recurrent Networks in MLX* builds chapter by
chapter.  On Linux its import routes MLX's matmuls to an optimised BLAS, whether
``mlx.core`` was imported before it or not (see :mod:`seqlib._blas`).
"""

from seqlib._blas import route_mlx_blas as _route_mlx_blas

_route_mlx_blas()  # best before anything below imports mlx.core (else it rebinds MLX)

from seqlib import (  # noqa: E402
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
    native,
    nn,
    optim,
    pointwise,
    reference,
    scan,
    sparse,
)
from seqlib._blas import BlasRoutingWarning, BlasStatus  # noqa: E402
from seqlib.export import export_function  # noqa: E402
from seqlib.interop import from_torch  # noqa: E402
from seqlib.nn import Embedding, EmbeddingBag  # noqa: E402
from seqlib.sparse import SparseGradient  # noqa: E402

__version__ = "0.1.0"


def blas_status() -> BlasStatus:
    """How MLX's BLAS is set up in this process (routed to OpenBLAS or not, and why)."""
    from seqlib import _blas

    return _blas.status


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
    "native",
    "nn",
    "optim",
    "pointwise",
    "reference",
    "scan",
    "sparse",
]
