"""seqlib's Metal kernels: their sources, the backend switch, checked launches and gradients.

The kernels are plain ``.metal`` files: the *bodies* that ``mx.fast.metal_kernel``
wraps in a generated signature, plus one shared header (``seqlib_math.h``).  In a
source checkout they sit in the top-level ``metal_kernels/`` folder; an installed
wheel ships them as package data in ``seqlib/metal_kernels/``.

Backends.  On a Mac with Metal, seqlib's modules run these kernels; elsewhere
they run the MLX-ops path (``seqlib.recurrent``, ``seqlib.functional``), which
gives the same numbers within float32 rounding (the kernels use the precise
tanh, the ops path a rational tanh good to 4e-7; atomic scatter-adds sum in a
different order).  To force either path::

    SEQLIB_BACKEND=ops python train.py         # or metal, or auto (the default)

    with seqlib.kernels.use_backend("ops"):    # inside one block
        ...

Every launch below checks shapes, dtypes and index ranges first, so a bad
argument raises a ValueError/TypeError/IndexError here rather than reading
outside a buffer on the GPU.  The differentiable wrappers are
``mx.custom_function``s whose VJPs launch the backward kernels, so ``mx.grad`` and
``mlx.nn.value_and_grad`` work through them.

The test suite runs every kernel on Linux through a C++ emulation of Metal that
it swaps in for ``mx.fast.metal_kernel`` (``tests/metal_emulation``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from seqlib._bags import checked_offsets
from seqlib._checks import as_index_array, check_batch_sizes, check_choice, check_index_range, check_max_norm
from seqlib._checks import check_per_sample_weights, normalize_padding_idx

__all__ = [
    "BACKENDS",
    "backend",
    "embedding",
    "embedding_bag",
    "embedding_bag_sparse_rows",
    "embedding_renorm_scales",
    "gru_cell",
    "gru_cell_backward",
    "gru_sequence",
    "kernel_dir",
    "kernel_header",
    "kernel_names",
    "kernel_source",
    "lstm_cell",
    "lstm_cell_backward",
    "lstm_sequence",
    "metal_available",
    "rnn_cell",
    "rnn_cell_backward",
    "use_backend",
]

# ----------------------------------------------------------------- sources

_PACKAGE_DIR = Path(__file__).resolve().parent
_CANDIDATES = (
    _PACKAGE_DIR / "metal_kernels",  # installed wheel (package data)
    _PACKAGE_DIR.parent / "metal_kernels",  # source checkout / editable install
)
HEADER_NAME = "seqlib_math.h"


KERNEL_DIR_ENV = "SEQLIB_KERNEL_DIR"


def kernel_dir() -> Path:
    """The folder holding the ``.metal`` sources (``$SEQLIB_KERNEL_DIR`` if set: for trying edited kernels)."""
    if os.environ.get(KERNEL_DIR_ENV):
        return Path(os.environ[KERNEL_DIR_ENV])
    for folder in _CANDIDATES:
        if any(folder.glob("*.metal")):
            return folder
    searched = ", ".join(str(folder) for folder in _CANDIDATES)
    raise FileNotFoundError(f"seqlib's Metal kernel sources were not found (looked in {searched})")


def kernel_names() -> list[str]:
    """The names of all available kernels (file names without ``.metal``)."""
    return sorted(path.stem for path in kernel_dir().glob("*.metal"))


def kernel_source(name: str) -> str:
    """The text of ``metal_kernels/<name>.metal``."""
    names = kernel_names()
    if name not in names:
        raise ValueError(f"name: no Metal kernel called {name!r}; available: {', '.join(names)}")
    return (kernel_dir() / f"{name}.metal").read_text()


def kernel_header() -> str:
    """The helpers every kernel is built with (``metal_kernels/seqlib_math.h``)."""
    return (kernel_dir() / HEADER_NAME).read_text()


# ----------------------------------------------------------------- backend choice

BACKEND_ENV = "SEQLIB_BACKEND"
BACKENDS = ("auto", "metal", "ops")
_override: list[str] = []  # innermost use_backend() last


def metal_available() -> bool:
    """Whether this machine can run Metal kernels (an Apple-silicon Mac)."""
    return mx.metal.is_available()


def _requested() -> str:
    choice = _override[-1] if _override else os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}: expected one of {BACKENDS}, got {choice!r}")
    return choice


def backend() -> str:
    """``"metal"`` or ``"ops"``: the path seqlib's modules take now."""
    choice = _requested()
    if choice == "auto":
        return "metal" if metal_available() else "ops"
    if choice == "metal" and not metal_available():
        raise RuntimeError(
            f"backend 'metal' was requested ({BACKEND_ENV} or use_backend), but Metal is not available "
            "on this machine; use 'ops' or 'auto'"
        )
    return choice


@contextlib.contextmanager
def use_backend(name: str):
    """Run the block with seqlib's modules on ``"metal"``, ``"ops"`` or ``"auto"``."""
    if name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    _override.append(name)
    try:
        backend()  # fail now, not at the first launch, if Metal was asked for and is missing
        yield
    finally:
        _override.pop()


# ----------------------------------------------------------------- building

_factory = None  # None: mx.fast.metal_kernel.  The tests put their Metal emulation here.


@functools.cache
def _build(factory, name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], atomic: bool):
    return factory(
        name=name,
        input_names=list(inputs),
        output_names=list(outputs),
        source=kernel_source(name),
        header=kernel_header(),
        ensure_row_contiguous=True,
        atomic_outputs=atomic,
    )


def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], atomic: bool = False):
    factory = _factory if _factory is not None else mx.fast.metal_kernel
    return _build(factory, name, inputs, outputs, atomic)


def _elementwise_launch(rows: int, columns: int) -> dict:
    """Grid for one thread per (row, column) element: x runs along a row, so loads coalesce."""
    return {"grid": (columns, rows, 1), "threadgroup": (64, 4, 1)}


def _scalar(value: int) -> mx.array:
    return mx.array(value, dtype=mx.int32)


# ----------------------------------------------------------------- checks

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check_float(name: str, array, ndim: int | None = None, dtype=None) -> None:
    if not isinstance(array, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array, got {type(array).__name__}")
    if array.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {array.dtype}")
    if dtype is not None and array.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (that of the other inputs), got {array.dtype}")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(array.shape)}")


def _check_shape(name: str, array: mx.array, shape: tuple[int, ...], dtype=None) -> None:
    _check_float(name, array, len(shape), dtype)
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(array.shape)}")


def _check_rows(name: str, array: mx.array, width_name: str) -> tuple[int, int]:
    _check_float(name, array, 2)
    rows, width = array.shape
    if rows == 0 or width == 0:
        raise ValueError(f"{name}: expected a non-empty (rows, {width_name}) array, got shape {tuple(array.shape)}")
    return rows, width


# ----------------------------------------------------------------- recurrent cells


def lstm_cell(gates: mx.array, c_prev: mx.array):
    """lstm_cell.metal: ``h, c, activations, tanh_c`` from gates (B, 4H) and c_prev (B, H).

    Same contract as :func:`seqlib.recurrent.lstm_pointwise`.
    """
    batch, hidden_size = _check_rows("c_prev", c_prev, "hidden_size")
    _check_shape("gates", gates, (batch, 4 * hidden_size), c_prev.dtype)
    kernel = _kernel("lstm_cell", ("gates", "c_prev"), ("h", "c", "activations", "tanh_c"))
    dtype = c_prev.dtype
    return tuple(
        kernel(
            inputs=[gates, c_prev],
            template=[("T", dtype)],
            output_shapes=[c_prev.shape, c_prev.shape, gates.shape, c_prev.shape],
            output_dtypes=[dtype] * 4,
            **_elementwise_launch(batch, hidden_size),
        )
    )


def lstm_cell_backward(d_h, d_c, activations, tanh_c, c_prev):
    """lstm_cell_backward.metal: ``d_gates (B, 4H), d_c_prev (B, H)``
    (contract of :func:`seqlib.recurrent.lstm_pointwise_backward`)."""
    batch, hidden_size = _check_rows("c_prev", c_prev, "hidden_size")
    dtype = c_prev.dtype
    for name, array in (("d_h", d_h), ("d_c", d_c), ("tanh_c", tanh_c)):
        _check_shape(name, array, c_prev.shape, dtype)
    _check_shape("activations", activations, (batch, 4 * hidden_size), dtype)
    kernel = _kernel(
        "lstm_cell_backward", ("d_h", "d_c", "activations", "tanh_c", "c_prev"), ("d_gates", "d_c_prev")
    )
    return tuple(
        kernel(
            inputs=[d_h, d_c, activations, tanh_c, c_prev],
            template=[("T", dtype)],
            output_shapes=[activations.shape, c_prev.shape],
            output_dtypes=[dtype, dtype],
            **_elementwise_launch(batch, hidden_size),
        )
    )


def gru_cell(input_side: mx.array, hidden_side: mx.array, h_prev: mx.array):
    """gru_cell.metal: ``h (B, H), activations (B, 3H)`` (contract of :func:`seqlib.recurrent.gru_pointwise`)."""
    batch, hidden_size = _check_rows("h_prev", h_prev, "hidden_size")
    dtype = h_prev.dtype
    _check_shape("input_side", input_side, (batch, 3 * hidden_size), dtype)
    _check_shape("hidden_side", hidden_side, (batch, 3 * hidden_size), dtype)
    kernel = _kernel("gru_cell", ("input_side", "hidden_side", "h_prev"), ("h", "activations"))
    return tuple(
        kernel(
            inputs=[input_side, hidden_side, h_prev],
            template=[("T", dtype)],
            output_shapes=[h_prev.shape, input_side.shape],
            output_dtypes=[dtype, dtype],
            **_elementwise_launch(batch, hidden_size),
        )
    )


def gru_cell_backward(d_h, activations, hidden_side, h_prev):
    """gru_cell_backward.metal: ``d_input_side, d_hidden_side (B, 3H), d_h_prev (B, H)``
    (contract of :func:`seqlib.recurrent.gru_pointwise_backward`)."""
    batch, hidden_size = _check_rows("h_prev", h_prev, "hidden_size")
    dtype = h_prev.dtype
    _check_shape("d_h", d_h, h_prev.shape, dtype)
    _check_shape("activations", activations, (batch, 3 * hidden_size), dtype)
    _check_shape("hidden_side", hidden_side, (batch, 3 * hidden_size), dtype)
    kernel = _kernel(
        "gru_cell_backward",
        ("d_h", "activations", "hidden_side", "h_prev"),
        ("d_input_side", "d_hidden_side", "d_h_prev"),
    )
    return tuple(
        kernel(
            inputs=[d_h, activations, hidden_side, h_prev],
            template=[("T", dtype)],
            output_shapes=[activations.shape, activations.shape, h_prev.shape],
            output_dtypes=[dtype] * 3,
            **_elementwise_launch(batch, hidden_size),
        )
    )


NONLINEARITIES = ("tanh", "relu")


def _check_nonlinearity(nonlinearity: str) -> None:
    check_choice("nonlinearity", nonlinearity, NONLINEARITIES)


def rnn_cell(pre: mx.array, nonlinearity: str = "tanh") -> mx.array:
    """rnn_cell.metal: ``tanh(pre)`` or ``relu(pre)`` for pre (B, H)."""
    _check_nonlinearity(nonlinearity)
    batch, hidden_size = _check_rows("pre", pre, "hidden_size")
    kernel = _kernel("rnn_cell", ("pre",), ("h",))
    return kernel(
        inputs=[pre],
        template=[("T", pre.dtype), ("RELU", nonlinearity == "relu")],
        output_shapes=[pre.shape],
        output_dtypes=[pre.dtype],
        **_elementwise_launch(batch, hidden_size),
    )[0]


def rnn_cell_backward(d_h: mx.array, h: mx.array, nonlinearity: str = "tanh") -> mx.array:
    """rnn_cell_backward.metal: the gradient w.r.t. the pre-activation, from rnn_cell's output h."""
    _check_nonlinearity(nonlinearity)
    batch, hidden_size = _check_rows("h", h, "hidden_size")
    _check_shape("d_h", d_h, h.shape, h.dtype)
    kernel = _kernel("rnn_cell_backward", ("d_h", "h"), ("d_pre",))
    return kernel(
        inputs=[d_h, h],
        template=[("T", h.dtype), ("RELU", nonlinearity == "relu")],
        output_shapes=[h.shape],
        output_dtypes=[h.dtype],
        **_elementwise_launch(batch, hidden_size),
    )[0]


# ----------------------------------------------------------------- whole-sequence kernels

SEQUENCE_KERNEL_MAX_HIDDEN = 1024  # the threadgroup arrays hold 1024 floats per state vector
SEQUENCE_KERNEL_MAX_BATCH = 8  # above this, one matmul per step beats re-reading W_hh per sequence
SEQUENCE_THREADS = 256  # 8 SIMD groups per sequence
LSTM_SEQUENCE_VERSIONS = {"simd": "lstm_sequence", "simple": "lstm_sequence_simple"}


def _packed_steps(batch_sizes, total_rows: int, batch: int) -> tuple[mx.array, mx.array]:
    """(step_offsets, batch_sizes) as int32 arrays, after checking they describe ``total_rows`` packed rows
    of ``batch`` sequences (integers only: float sizes are refused, not truncated)."""
    sizes = np.array(check_batch_sizes(batch_sizes, total_rows, batch, rows_name="x_gates"), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return mx.array(offsets.astype(np.int32)), mx.array(sizes.astype(np.int32))


def _check_sequence(x_gates, w_hh, h0, gate_blocks: int):
    batch, hidden_size = _check_rows("h0", h0, "hidden_size")
    dtype = h0.dtype
    if hidden_size > SEQUENCE_KERNEL_MAX_HIDDEN:
        raise ValueError(
            f"h0: the whole-sequence kernel serves hidden_size <= {SEQUENCE_KERNEL_MAX_HIDDEN} "
            f"(its state lives in 32 KB of threadgroup memory), got {hidden_size}"
        )
    _check_float("x_gates", x_gates, 2, dtype)
    if x_gates.shape[1] != gate_blocks * hidden_size:
        raise ValueError(
            f"x_gates: expected shape (N, {gate_blocks * hidden_size}), got {tuple(x_gates.shape)}"
        )
    _check_shape("w_hh", w_hh, (gate_blocks * hidden_size, hidden_size), dtype)
    return batch, hidden_size, dtype


def _sequence_launch(batch: int) -> dict:
    return {"grid": (SEQUENCE_THREADS, batch, 1), "threadgroup": (SEQUENCE_THREADS, 1, 1)}


def lstm_sequence(x_gates, w_hh, h0, c0, batch_sizes, reverse: bool = False, version: str = "simd"):
    """lstm_sequence.metal: one LSTM layer-direction over packed rows, in one dispatch.

    x_gates (N, 4H) = x W_ih^T + b_ih + b_hh; w_hh (4H, H); h0, c0 (B, H);
    batch_sizes: rows per step (a PackedSequence's).  Returns
    ``output (N, H), h_n, c_n (B, H), activations (N, 4H), tanh_c, c_prev, h_prev (N, H)``:
    the last four are what :func:`seqlib.recurrent.lstm_sequence`'s backward needs.
    ``version``: ``"simd"`` (one SIMD group per unit) or ``"simple"`` (one thread per unit).
    """
    if version not in LSTM_SEQUENCE_VERSIONS:
        raise ValueError(f"version: expected one of {list(LSTM_SEQUENCE_VERSIONS)}, got {version!r}")
    batch, hidden_size, dtype = _check_sequence(x_gates, w_hh, h0, 4)
    _check_shape("c0", c0, h0.shape, dtype)
    step_offsets, sizes = _packed_steps(batch_sizes, x_gates.shape[0], batch)
    kernel = _kernel(
        LSTM_SEQUENCE_VERSIONS[version],
        ("x_gates", "w_hh", "h0", "c0", "step_offsets", "batch_sizes"),
        ("output", "h_n", "c_n", "activations", "tanh_c", "c_prev", "h_prev"),
    )
    rows = (x_gates.shape[0], hidden_size)
    return tuple(
        kernel(
            inputs=[x_gates, w_hh, h0, c0, step_offsets, sizes],
            template=[("T", dtype), ("REVERSE", bool(reverse))],
            output_shapes=[rows, h0.shape, h0.shape, x_gates.shape, rows, rows, rows],
            output_dtypes=[dtype] * 7,
            **_sequence_launch(batch),
        )
    )


def gru_sequence(x_gates, w_hh, b_hh, h0, batch_sizes, reverse: bool = False):
    """gru_sequence.metal: one GRU layer-direction over packed rows, in one dispatch.

    x_gates (N, 3H) = x W_ih^T + b_ih; w_hh (3H, H); b_hh (3H,); h0 (B, H).  Returns
    ``output (N, H), h_n (B, H), activations (N, 3H), hidden_side (N, 3H), h_prev (N, H)``.
    """
    batch, hidden_size, dtype = _check_sequence(x_gates, w_hh, h0, 3)
    _check_shape("b_hh", b_hh, (3 * hidden_size,), dtype)
    step_offsets, sizes = _packed_steps(batch_sizes, x_gates.shape[0], batch)
    kernel = _kernel(
        "gru_sequence",
        ("x_gates", "w_hh", "b_hh", "h0", "step_offsets", "batch_sizes"),
        ("output", "h_n", "activations", "hidden_side", "h_prev"),
    )
    rows = (x_gates.shape[0], hidden_size)
    return tuple(
        kernel(
            inputs=[x_gates, w_hh, b_hh, h0, step_offsets, sizes],
            template=[("T", dtype), ("REVERSE", bool(reverse))],
            output_shapes=[rows, h0.shape, x_gates.shape, x_gates.shape, rows],
            output_dtypes=[dtype] * 5,
            **_sequence_launch(batch),
        )
    )


def sequence_kernel_serves(batch: int, hidden_size: int) -> bool:
    """Whether the recurrent layers use the whole-sequence kernels for this shape (else one kernel per step)."""
    for name, value in (("batch", batch), ("hidden_size", hidden_size)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return batch <= SEQUENCE_KERNEL_MAX_BATCH and hidden_size <= SEQUENCE_KERNEL_MAX_HIDDEN


# ----------------------------------------------------------------- embeddings
#
# Each public function checks its arguments and then calls its unchecked twin
# (underscored).  seqlib.functional, which has already run the same checks with
# its own messages, calls the twins directly, so an index range (an evaluation)
# is never checked twice on the way to a kernel.


def _check_table(weight, padding_idx=None) -> tuple[int, int, int | None]:
    """``(V, D, padding row)``: weight must be a (V, D) float array; padding_idx in [-V, V) or None, as in torch."""
    _check_float("weight", weight, 2)
    num_embeddings, embedding_dim = weight.shape
    return num_embeddings, embedding_dim, normalize_padding_idx(padding_idx, num_embeddings)


def _checked_indices(name: str, indices, num_embeddings: int) -> mx.array:
    """``indices`` flattened to int32, after checking they are integers in [0, num_embeddings)."""
    indices = as_index_array(indices, name)
    check_index_range(indices, num_embeddings, name)
    return indices.reshape(-1).astype(mx.int32)


def _padding(padding_idx: int | None) -> mx.array:
    return _scalar(-1 if padding_idx is None else int(padding_idx))


def _embedding_backward(d_out, flat_indices, num_embeddings, padding_idx, grad_scale):
    """embedding_backward.metal: scatter-add of (N, D) row gradients into a (V, D) float32 table."""
    num_lookups, embedding_dim = d_out.shape
    scaled = grad_scale is not None
    kernel = _kernel("embedding_backward", ("d_out", "indices", "grad_scale", "padding_idx"), ("d_weight",), True)
    return kernel(
        inputs=[d_out, flat_indices, grad_scale if scaled else mx.ones((1,)), _padding(padding_idx)],
        template=[("T", d_out.dtype), ("SCALED", scaled)],
        output_shapes=[(num_embeddings, embedding_dim)],
        output_dtypes=[mx.float32],
        init_value=0,
        **_elementwise_launch(num_lookups, embedding_dim),
    )[0]


def embedding(weight: mx.array, indices: mx.array, padding_idx: int | None = None, grad_scale=None) -> mx.array:
    """Differentiable lookup through embedding_gather.metal, gradient by embedding_backward.metal.

    indices: any shape, integers in [0, V); padding_idx: a row in [-V, V) (negative
    counts from the end, as in torch) that gets no gradient, or None; grad_scale: (N,)
    float factor per lookup (N = indices.size), or None.  Returns (*indices.shape, D).
    """
    num_embeddings, _, padding_idx = _check_table(weight, padding_idx)
    flat = _checked_indices("indices", indices, num_embeddings)
    if grad_scale is not None:
        _check_shape("grad_scale", grad_scale, (flat.size,))
    return _embedding(weight, flat.reshape(tuple(indices.shape)), padding_idx, grad_scale)


def _embedding(weight, indices, padding_idx, grad_scale) -> mx.array:
    """:func:`embedding` for arguments already checked."""
    num_embeddings, embedding_dim = weight.shape
    shape = tuple(indices.shape)
    flat = indices.reshape(-1).astype(mx.int32)
    if flat.size == 0 or embedding_dim == 0:  # nothing to launch (torch: an empty result too)
        return mx.zeros((*shape, embedding_dim), weight.dtype)
    gather = _kernel("embedding_gather", ("weight", "indices"), ("out",))

    @mx.custom_function
    def lookup(table):
        return gather(
            inputs=[table, flat],
            output_shapes=[(flat.size, embedding_dim)],
            output_dtypes=[table.dtype],
            **_elementwise_launch(flat.size, embedding_dim),
        )[0]

    @lookup.vjp
    def lookup_vjp(table, cotangent, output):
        d_weight = _embedding_backward(cotangent, flat, num_embeddings, padding_idx, grad_scale)
        return d_weight.astype(table.dtype)

    return lookup(weight).reshape(*shape, embedding_dim)


_NORM_CODES = {1.0: 1, 2.0: 2}


def embedding_renorm_scales(weight: mx.array, rows: mx.array, max_norm: float, norm_type: float = 2.0) -> mx.array:
    """embedding_renorm.metal: for each of ``rows`` (U,) the factor that brings it inside ``max_norm``.

    Returns (U,) float32: ``max_norm / (norm + 1e-7)`` where the row's ``norm_type``-norm
    exceeds ``max_norm``, else 1.  ``max_norm`` >= 0, ``norm_type`` > 0 (inf allowed).
    """
    num_embeddings, _, _ = _check_table(weight)
    flat_rows = _checked_indices("rows", rows, num_embeddings)
    check_max_norm(max_norm, norm_type, required=True)
    return _embedding_renorm_scales(weight, flat_rows, max_norm, norm_type)


def _embedding_renorm_scales(weight, flat_rows, max_norm, norm_type) -> mx.array:
    """:func:`embedding_renorm_scales` for checked arguments: flat_rows (U,) int32 in range."""
    embedding_dim = weight.shape[1]
    if flat_rows.size == 0 or embedding_dim == 0:  # an empty row has norm 0: never rescaled
        return mx.ones((flat_rows.size,), mx.float32)
    norm_code = 0 if np.isinf(norm_type) else _NORM_CODES.get(float(norm_type), 3)
    threads = min(1024, -(-embedding_dim // 32) * 32)
    kernel = _kernel("embedding_renorm", ("weight", "rows", "max_norm", "norm_type"), ("scale",))
    return kernel(
        inputs=[weight, flat_rows, mx.array(float(max_norm)), mx.array(float(norm_type) if norm_code == 3 else 2.0)],
        template=[("T", weight.dtype), ("NORM", norm_code)],
        output_shapes=[(flat_rows.size,)],
        output_dtypes=[mx.float32],
        grid=(threads, flat_rows.size, 1),
        threadgroup=(threads, 1, 1),
    )[0]


BAG_MODES = {"sum": 0, "mean": 1, "max": 2}
_BAG_INPUTS = ("d_out", "indices", "bag_of_entry", "bag_size", "per_sample_weights", "max_entry", "padding_idx")


def _checked_bags(weight, indices, offsets, mode: str, per_sample_weights, padding_idx):
    """The checks embedding_bag and embedding_bag_sparse_rows share.

    Returns flat int32 indices, the bag ends (B + 1,) as NumPy and the padding row.
    """
    num_embeddings, _, padding_idx = _check_table(weight, padding_idx)
    if mode not in BAG_MODES:
        raise ValueError(f"mode: expected one of {tuple(BAG_MODES)}, got {mode!r}")
    indices = as_index_array(indices, "indices")
    if indices.ndim != 1:
        raise ValueError(f"indices: expected a 1-D array (bags come from offsets), got shape {tuple(indices.shape)}")
    flat = _checked_indices("indices", indices, num_embeddings)
    ends = checked_offsets(offsets, flat.size)
    check_per_sample_weights(per_sample_weights, mode, (flat.size,), weight.dtype, of="indices")
    return flat, ends, padding_idx


def _bag_membership(flat: mx.array, ends: np.ndarray, padding_idx):
    """Bag ends (B + 1,), each entry's bag (N,; -1: in none) and each bag's counted size (B,), as int32 arrays."""
    bag_of_entry = np.full(flat.size, -1, np.int32)
    bag_of_entry[: ends[-1]] = np.repeat(np.arange(ends.size - 1), np.diff(ends))
    counted = bag_of_entry >= 0
    if padding_idx is not None:
        counted &= np.asarray(flat) != padding_idx
    bag_size = np.bincount(bag_of_entry[counted], minlength=ends.size - 1).astype(np.int32)
    return mx.array(ends.astype(np.int32)), mx.array(bag_of_entry), mx.array(bag_size)


def _bag_forward(table, flat, ends, sample_weights, padding_idx, mode: str, weighted: bool):
    """embedding_bag.metal: ``out (B, D)`` and ``max_entry (B, D)``."""
    num_bags, embedding_dim = ends.size - 1, table.shape[1]
    kernel = _kernel(
        "embedding_bag", ("weight", "indices", "offsets", "per_sample_weights", "padding_idx"), ("out", "max_entry")
    )
    return kernel(
        inputs=[table, flat, ends, sample_weights, _padding(padding_idx)],
        template=[("T", table.dtype), ("MODE", BAG_MODES[mode]), ("WEIGHTED", weighted)],
        output_shapes=[(num_bags, embedding_dim), (num_bags, embedding_dim)],
        output_dtypes=[table.dtype, mx.int32],
        **_elementwise_launch(num_bags, embedding_dim),
    )


def embedding_bag(
    weight: mx.array,
    indices: mx.array,
    offsets: mx.array,
    mode: str = "mean",
    per_sample_weights: mx.array | None = None,
    padding_idx: int | None = None,
) -> mx.array:
    """Differentiable bags through embedding_bag.metal; gradients by the backward kernels.

    indices (N,) integers in [0, V); offsets (B + 1,) integers: bag b holds
    ``indices[offsets[b]:offsets[b + 1]]`` (the CSR form with the end included; entries
    after the last offset are in no bag); per_sample_weights (N,) of weight's dtype, in
    mode "sum" only; padding_idx in [-V, V) or None.  Returns (B, D); max mode as torch's
    CPU kernel (the first entry, then only strictly greater values: NaN only as the first).
    ``mx.grad`` reaches ``weight`` (embedding_bag_backward.metal) and
    ``per_sample_weights`` (embedding_bag_per_sample_weights_backward.metal).
    """
    flat, ends, padding_idx = _checked_bags(weight, indices, offsets, mode, per_sample_weights, padding_idx)
    return _embedding_bag(weight, flat, ends, mode, per_sample_weights, padding_idx)


def _embedding_bag(weight, flat, ends: np.ndarray, mode, per_sample_weights, padding_idx) -> mx.array:
    """:func:`embedding_bag` for checked arguments: flat (N,) int32 indices in range, ends (B + 1,) NumPy."""
    ends, bag_of_entry, bag_size = _bag_membership(flat, ends, padding_idx)
    num_bags, embedding_dim = ends.size - 1, weight.shape[1]
    weighted = per_sample_weights is not None
    if flat.size == 0 or num_bags == 0 or embedding_dim == 0:  # nothing to launch: empty bags give zeros
        return mx.zeros((num_bags, embedding_dim), weight.dtype)
    mode_code = BAG_MODES[mode]
    padding = _padding(padding_idx)

    @mx.custom_function
    def bag(table, sample_weights):
        return tuple(_bag_forward(table, flat, ends, sample_weights, padding_idx, mode, weighted))

    @bag.vjp
    def bag_vjp(primals, cotangents, outputs):
        table, sample_weights = primals
        d_out, max_entry = cotangents[0], outputs[1]
        backward = _kernel("embedding_bag_backward", _BAG_INPUTS, ("d_weight",), True)
        items = num_bags if mode == "max" else flat.size
        d_weight = backward(
            inputs=[d_out, flat, bag_of_entry, bag_size, sample_weights, max_entry, padding],
            template=[("T", d_out.dtype), ("MODE", mode_code), ("WEIGHTED", weighted)],
            output_shapes=[table.shape],
            output_dtypes=[mx.float32],
            init_value=0,
            **_elementwise_launch(items, embedding_dim),
        )[0].astype(table.dtype)
        if not weighted:
            return d_weight, mx.zeros_like(sample_weights)
        weights_kernel = _kernel(
            "embedding_bag_per_sample_weights_backward",
            ("d_out", "weight", "indices", "bag_of_entry", "padding_idx"),
            ("d_per_sample_weights",),
        )
        d_sample_weights = weights_kernel(
            inputs=[d_out, table, flat, bag_of_entry, padding],
            template=[("T", sample_weights.dtype)],
            output_shapes=[(flat.size,)],
            output_dtypes=[sample_weights.dtype],
            grid=(32, flat.size, 1),
            threadgroup=(32, 8, 1),
        )[0]
        return d_weight, d_sample_weights

    sample_weights = per_sample_weights if weighted else mx.ones((1,), weight.dtype)
    return bag(weight, sample_weights)[0]


def embedding_bag_sparse_rows(
    d_out: mx.array,
    weight: mx.array,
    indices: mx.array,
    offsets: mx.array,
    mode: str = "mean",
    per_sample_weights: mx.array | None = None,
    padding_idx: int | None = None,
) -> mx.array:
    """embedding_bag_sparse_backward.metal: the table gradient as one (N, D) row per entry.

    Row n is what entry n sends to ``weight[indices[n]]`` (torch's uncoalesced sparse
    gradient: adding rows with equal indices gives the dense gradient's rows).  Arguments
    as :func:`embedding_bag`'s; d_out (B, D) in weight's dtype.
    """
    flat, ends, padding_idx = _checked_bags(weight, indices, offsets, mode, per_sample_weights, padding_idx)
    ends, bag_of_entry, bag_size = _bag_membership(flat, ends, padding_idx)
    embedding_dim = weight.shape[1]
    _check_shape("d_out", d_out, (ends.size - 1, embedding_dim), weight.dtype)
    weighted = per_sample_weights is not None
    if flat.size == 0 or embedding_dim == 0:  # nothing to launch: still one (empty) row per entry
        return mx.zeros((flat.size, embedding_dim), d_out.dtype)
    max_entry = mx.full((1,), -1, mx.int32)
    if mode == "max":
        no_weights = mx.ones((1,), weight.dtype)
        max_entry = _bag_forward(weight, flat, ends, no_weights, padding_idx, "max", False)[1]
    sample_weights = per_sample_weights if weighted else mx.ones((1,), d_out.dtype)
    kernel = _kernel("embedding_bag_sparse_backward", _BAG_INPUTS, ("d_rows",))
    return kernel(
        inputs=[d_out, flat, bag_of_entry, bag_size, sample_weights, max_entry, _padding(padding_idx)],
        template=[("T", d_out.dtype), ("MODE", BAG_MODES[mode]), ("WEIGHTED", weighted)],
        output_shapes=[(flat.size, embedding_dim)],
        output_dtypes=[d_out.dtype],
        **_elementwise_launch(flat.size, embedding_dim),
    )[0]
