"""seqlib's Metal kernels: where they come from, where they run, and their checked, differentiable launchers.

Layout (one module per kernel family; each launcher sits with its checks and its VJP):

- :mod:`~seqlib.kernels.runtime`: the ``.metal`` sources, the backend switch
  (``"metal"``, ``"emulate"``, ``"ops"``, ``"auto"``) and building a kernel for it;
- :mod:`~seqlib.kernels.cell_kernels`: one recurrent step's fused gate math
  (``lstm_cell``, ``gru_cell``, ``rnn_cell`` and their backwards);
- :mod:`~seqlib.kernels.sequence_kernels`: a whole layer-direction in one launch
  (``lstm_sequence``, ``lstm_sequence_simple``, ``gru_sequence``);
- :mod:`~seqlib.kernels.embedding_kernels`: lookups, their scatter-add gradient, renormalisation;
- :mod:`~seqlib.kernels.bag_kernels`: bags of lookups and their gradients;
- :mod:`~seqlib.kernels.catalog`: every kernel's :class:`~seqlib.kernels.runtime.KernelSpec`
  by name, and the source MLX generates for it.

On a Mac with Metal, seqlib's modules run these kernels; elsewhere they run the
MLX-ops path (:mod:`seqlib.pointwise`, :mod:`seqlib.scan`, :mod:`seqlib.functional`),
which gives the same numbers within float32 rounding (the kernels use the precise
tanh, the ops path a rational tanh good to 4e-7; atomic scatter-adds sum in another
order).  Any machine with a C++ compiler can run the kernels themselves through
:mod:`seqlib.emulation`::

    SEQLIB_BACKEND=emulate python train.py     # or metal, ops, auto (the default)

    with seqlib.kernels.use_backend("emulate"):    # inside one block
        ...

Every launcher checks shapes, dtypes and index ranges first, so a bad argument
raises a ValueError/TypeError/IndexError here rather than reading outside a
buffer on the GPU.  The differentiable ones are ``mx.custom_function``s whose
VJPs launch the backward kernels, so ``mx.grad`` and ``mlx.nn.value_and_grad``
work through them.
"""

from seqlib.kernels.runtime import (
    BACKEND_ENV,
    BACKENDS,
    HEADER_NAME,
    KERNEL_DIR_ENV,
    KERNEL_DTYPES,
    KernelSpec,
    backend,
    build_kernel,
    elementwise_launch,
    forget_built_kernels,
    kernel_dir,
    kernel_header,
    kernel_names,
    kernel_source,
    metal_available,
    use_backend,
    uses_kernels,
)
from seqlib.kernels.bag_kernels import BagMode, embedding_bag
from seqlib.kernels.catalog import KERNEL_SPECS, generated_source
from seqlib.kernels.cell_kernels import (
    NONLINEARITIES,
    gru_pointwise,
    gru_pointwise_backward,
    lstm_pointwise,
    lstm_pointwise_backward,
    rnn_activation,
    rnn_activation_backward,
)
from seqlib.kernels.embedding_kernels import NormKind, embedding, embedding_renorm_scales
from seqlib.kernels.sequence_kernels import (
    LSTM_SEQUENCE_VERSIONS,
    SEQUENCE_KERNEL_MAX_BATCH,
    SEQUENCE_KERNEL_MAX_HIDDEN,
    gru_sequence_forward,
    lstm_sequence_forward,
    sequence_kernel_serves,
)

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "HEADER_NAME",
    "KERNEL_DIR_ENV",
    "KERNEL_DTYPES",
    "KERNEL_SPECS",
    "LSTM_SEQUENCE_VERSIONS",
    "NONLINEARITIES",
    "SEQUENCE_KERNEL_MAX_BATCH",
    "SEQUENCE_KERNEL_MAX_HIDDEN",
    "BagMode",
    "KernelSpec",
    "NormKind",
    "backend",
    "build_kernel",
    "elementwise_launch",
    "embedding",
    "embedding_bag",
    "embedding_renorm_scales",
    "forget_built_kernels",
    "generated_source",
    "gru_pointwise",
    "gru_pointwise_backward",
    "gru_sequence_forward",
    "kernel_dir",
    "kernel_header",
    "kernel_names",
    "kernel_source",
    "lstm_pointwise",
    "lstm_pointwise_backward",
    "lstm_sequence_forward",
    "metal_available",
    "rnn_activation",
    "rnn_activation_backward",
    "sequence_kernel_serves",
    "use_backend",
    "uses_kernels",
]
