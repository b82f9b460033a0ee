"""``Embedding`` and ``EmbeddingBag``: torch.nn's lookup tables as ``mlx.nn`` modules."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from seqlib import functional as F
from seqlib import sparse
from seqlib._bags import check_bag_mode
from seqlib.graph import is_traced
from seqlib._checks import check_max_norm, check_nonnegative_ints, check_weight, normalize_padding_idx
from seqlib.nn.state_dict import TorchStateDictMixin
from seqlib._torch_arrays import to_mlx_array

class _Table(TorchStateDictMixin, nn.Module):
    """What Embedding and EmbeddingBag share: the (V, D) ``weight`` and its options.

    Sizes may be 0, as in torch (an empty table); ``_weight`` (V, D), as torch's, is
    taken as the weight instead of a random one (its padding row left as given),
    ``_freeze`` freezes it.  Unlike torch, seqlib refuses at construction a negative
    ``max_norm`` (torch flips the rows' signs), a ``norm_type`` <= 0 (no norm) and an
    integer table (seqlib's tables are trained; torch looks integer tables up too).
    """

    def __init__(self, num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                 sparse, dtype, _weight=None, _freeze=False):  # fmt: skip
        super().__init__()
        check_nonnegative_ints(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
            raise TypeError(f"dtype: expected a floating mlx.core.Dtype, got {dtype!r}")
        check_max_norm(max_norm, norm_type)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self.sparse_recording = None  # what seqlib.sparse.value_and_grad records of this table (None outside it)
        if _weight is not None:
            self.weight = _checked_weight(_weight, (num_embeddings, embedding_dim))
        else:
            weight = mx.random.normal((num_embeddings, embedding_dim)).astype(dtype)  # N(0, 1), like torch
            if self.padding_idx is not None:
                weight[self.padding_idx] = 0
            self.weight = weight
        if _freeze:
            self.freeze()

    @classmethod
    def _wrap(cls, embeddings: mx.array, freeze: bool, **options):
        if not isinstance(embeddings, mx.array):  # NumPy or a torch tensor, as load_torch_state_dict takes
            embeddings = to_mlx_array(embeddings, name="embeddings")
        check_weight(embeddings, "embeddings")
        num_embeddings, embedding_dim = embeddings.shape
        module = cls(num_embeddings, embedding_dim, dtype=embeddings.dtype, **options)
        module.weight = embeddings  # kept as given: torch leaves the padding row alone here too
        if freeze:
            module.freeze()
        return module

    def _look_up(self, lookup, input: mx.array):
        """``lookup(table, input, padding_idx)``, renormalising first if asked.

        The renormalised table replaces ``self.weight`` only once the lookup has
        accepted its arguments, so a call that raises leaves the module unchanged, and
        only where it is a value of the module's state: not where a transformation traces
        the indices but not the weight (``mx.vmap``, or ``mx.compile`` without the model's
        state as its inputs and outputs), which would leave a tracer in the module.
        """
        table, input, padding_idx = sparse.lookup_table(self, input)
        renorm = self.max_norm is not None and table is self.weight
        if renorm:
            table = F.renorm_for_lookup(self.weight, input, self.max_norm, self.norm_type)
        output = lookup(table, input, padding_idx)
        if renorm and (is_traced(self.weight) or not is_traced(table)):
            self.weight = table
        return output

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        """This table with its weight quantized by ``mx.quantize`` (for inference; ``mlx.nn.quantize`` calls
        this): a :class:`~seqlib.nn.QuantizedEmbedding` or :class:`~seqlib.nn.QuantizedEmbeddingBag`.
        ``embedding_dim`` must be a multiple of ``group_size``; a table with ``max_norm`` is refused (a
        frozen table is not renormalised)."""
        from seqlib.nn.quantized import QuantizedEmbedding, QuantizedEmbeddingBag

        if self.max_norm is not None:
            raise ValueError(f"max_norm: a quantized table is frozen and cannot be renormalised on lookup; got "
                             f"max_norm={self.max_norm} (renormalise the weight first, then set max_norm=None)")
        if self.embedding_dim % group_size:
            raise ValueError(f"group_size: embedding_dim ({self.embedding_dim}) must be a multiple of it, "
                             f"got {group_size}")
        kind = QuantizedEmbeddingBag if isinstance(self, EmbeddingBag) else QuantizedEmbedding
        return kind(self, group_size, bits, mode)

    def _extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        for name in ("padding_idx", "max_norm"):
            if getattr(self, name) is not None:
                text += f", {name}={getattr(self, name)}"
        if self.norm_type != 2.0:
            text += f", norm_type={self.norm_type}"
        for name in ("scale_grad_by_freq", "sparse"):
            if getattr(self, name):
                text += f", {name}=True"
        return text


class Embedding(_Table):
    r"""A lookup table from integer ids to rows of a learned ``weight``, torch's ``nn.Embedding``.

    For ids of any shape it returns one row per id,

    .. math::

        \mathrm{out}[\ldots, :] = W[\mathrm{input}[\ldots], :], \qquad W \in \mathbb{R}^{V \times D},

    which is the product of a one-hot vector with :math:`W`, without building the one-hot.
    The single parameter is ``weight``, initialised :math:`\mathcal{N}(0, 1)` like torch's, with the
    ``padding_idx`` row (if any) set to zero; that row never receives a gradient.
    With ``max_norm`` set, each call renormalises the rows it looks up and
    *replaces* ``self.weight`` with the result, so that afterwards ``self.weight``
    equals what torch's in-place renormalisation leaves.  Under ``mx.compile`` with the
    model's state as inputs and outputs (a training step) the replacement is captured; under
    ``mx.vmap``, or a compiled forward that does not capture the state, the lookup reads the
    renormalised rows and the module keeps its weight.  With ``sparse=True``,
    :func:`seqlib.sparse.value_and_grad` gives the weight's gradient as a
    :class:`~seqlib.sparse.SparseGradient` of the looked-up rows only.

    Args:
        num_embeddings: V, the number of rows (ids run from 0 to V - 1).
        embedding_dim: D, the size of each row.
        padding_idx: a row (negative counts from the end) that starts at zero and gets no
            gradient, or None. Default None.
        max_norm: if given, rows are rescaled on lookup to :math:`\lVert w \rVert_p \le` ``max_norm``
            (see :func:`seqlib.functional.embedding_renorm`). Default None.
        norm_type: p of the norm for ``max_norm``. Default 2.
        scale_grad_by_freq: divide each row's gradient by how often its id occurs in the call's
            input. Default False.
        sparse: the weight's gradient as a :class:`~seqlib.sparse.SparseGradient` under
            :func:`seqlib.sparse.value_and_grad`. Default False.
        dtype: the weight's dtype (float32, float16 or bfloat16). Default float32.

    Inputs:
        input: integer ids in ``[0, V)``, any shape ``(*)`` (an MLX or NumPy array).

    Outputs:
        output: the looked-up rows, ``(*, D)``, in the weight's dtype.

    Weights:
        weight: :math:`W`, ``(V, D)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        dtype: mx.Dtype = mx.float32,
        *,
        _weight: mx.array | None = None,
        _freeze: bool = False,
    ):
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, dtype, _weight, _freeze)  # fmt: skip

    @classmethod
    def from_pretrained(
        cls,
        embeddings: mx.array,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> Embedding:
        """An Embedding whose weight is ``embeddings`` (V, D: an MLX or NumPy array or a torch tensor), frozen
        unless ``freeze=False``."""
        return cls._wrap(embeddings, freeze, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)  # fmt: skip

    def __call__(self, input: mx.array) -> mx.array:
        def lookup(table, input, padding_idx):
            return F.embedding(input, table, padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse)

        return self._look_up(lookup, input)


class EmbeddingBag(_Table):
    r"""Sums, means or maxima of bags of embedding rows, torch's ``nn.EmbeddingBag``.

    For bag b with the ids :math:`E_b` it does not build the ``(N, D)`` lookup in between; it
    computes, with per-sample weights :math:`s_n` (1 without ``per_sample_weights``),

    .. math::

        \begin{aligned}
        \text{sum:} \quad & \mathrm{out}_b = \sum_{n \in E_b} s_n\, W[\mathrm{input}_n] \\
        \text{mean:} \quad & \mathrm{out}_b = \frac{1}{|E_b|} \sum_{n \in E_b} W[\mathrm{input}_n] \\
        \text{max:} \quad & \mathrm{out}_{b, d} = \max_{n \in E_b} W[\mathrm{input}_n, d] \ \text{(each } d)
        \end{aligned}

    where entries equal to ``padding_idx`` are left out of :math:`E_b` and an empty bag gives
    zeros.  Options, parameter and ``from_pretrained`` as in :class:`Embedding`.  A bad ``mode``,
    or ``mode="max"`` with ``sparse`` or ``scale_grad_by_freq``, is refused here at construction
    (torch waits for the first call).

    Args:
        num_embeddings: V, the number of rows.
        embedding_dim: D, the size of each row.
        max_norm: rescale looked-up rows to this norm at most, as :class:`Embedding`. Default None.
        norm_type: p of the norm for ``max_norm``. Default 2.
        scale_grad_by_freq: as :class:`Embedding` (not with ``mode="max"``). Default False.
        mode: ``"sum"``, ``"mean"`` or ``"max"``. Default ``"mean"``.
        sparse: the weight's gradient as a :class:`~seqlib.sparse.SparseGradient` (not with
            ``mode="max"``). Default False.
        include_last_offset: ``offsets`` has B + 1 entries, the last one the end of the last bag.
            Default False.
        padding_idx: a row whose entries are left out of every bag, or None. Default None.
        dtype: the weight's dtype (float32, float16 or bfloat16). Default float32.

    Inputs:
        input: ids, ``(B, N)`` (B bags of N entries) or ``(N,)`` with ``offsets``.
        offsets: ``(B,)`` (``(B + 1,)`` with ``include_last_offset``), where each bag starts in a
            1-D ``input``; None for a 2-D input.
        per_sample_weights: weights :math:`s_n` of ``input``'s shape, for ``mode="sum"`` only.
            See :func:`seqlib.functional.embedding_bag` for every form.

    Outputs:
        output: one row per bag, ``(B, D)``, in the weight's dtype.

    Weights:
        weight: :math:`W`, ``(V, D)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        dtype: mx.Dtype = mx.float32,
        *,
        _weight: mx.array | None = None,
        _freeze: bool = False,
    ):
        check_bag_mode(mode, sparse, scale_grad_by_freq)
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                         sparse, dtype, _weight, _freeze)  # fmt: skip
        self.mode = mode
        self.include_last_offset = include_last_offset

    @classmethod
    def from_pretrained(
        cls,
        embeddings: mx.array,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
    ) -> EmbeddingBag:
        """An EmbeddingBag whose weight is ``embeddings`` (V, D: an MLX or NumPy array or a torch tensor), frozen
        unless ``freeze=False``."""
        return cls._wrap(embeddings, freeze, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, mode=mode, sparse=sparse,
                         include_last_offset=include_last_offset, padding_idx=padding_idx)  # fmt: skip

    def _extra_repr(self) -> str:
        text = super()._extra_repr() + f", mode={self.mode!r}"
        return text + (", include_last_offset=True" if self.include_last_offset else "")

    def __call__(self, input: mx.array, offsets: mx.array | None = None,
                 per_sample_weights: mx.array | None = None) -> mx.array:  # fmt: skip
        def lookup(table, input, padding_idx):
            return F.embedding_bag(
                input, table, offsets, None, self.norm_type, self.scale_grad_by_freq, self.mode, self.sparse,
                per_sample_weights, self.include_last_offset, padding_idx,
            )  # fmt: skip

        return self._look_up(lookup, input)


def _checked_weight(weight, shape: tuple[int, int]) -> mx.array:
    check_weight(weight, "_weight")
    if tuple(weight.shape) != shape:
        raise ValueError(
            f"_weight: expected shape {shape} (num_embeddings, embedding_dim), got {tuple(weight.shape)}"
        )
    return weight
