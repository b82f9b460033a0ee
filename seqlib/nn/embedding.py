"""``Embedding`` and ``EmbeddingBag``: torch.nn's lookup tables as ``mlx.nn`` modules."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from seqlib import functional as F
from seqlib import sparse
from seqlib._bags import check_bag_mode
from seqlib._checks import check_max_norm, check_nonnegative_ints, check_weight, normalize_padding_idx
from seqlib.nn.state_dict import TorchStateDictMixin

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
        accepted its arguments, so a call that raises leaves the module unchanged.
        """
        table, input, padding_idx = sparse.lookup_table(self, input)
        renorm = self.max_norm is not None and table is self.weight
        if renorm:
            table = F.renorm_for_lookup(self.weight, input, self.max_norm, self.norm_type)
        output = lookup(table, input, padding_idx)
        if renorm:
            self.weight = table
        return output

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
    """A lookup table from integer ids to rows of a learned ``weight`` (V, D).

    The single parameter is ``weight``, initialised N(0, 1) like torch's, with the
    ``padding_idx`` row (if any) set to zero; that row never receives a gradient.
    With ``max_norm`` set, each call renormalises the rows it looks up and
    *replaces* ``self.weight`` with the result, so that afterwards ``self.weight``
    equals what torch's in-place renormalisation leaves.  Under ``mx.compile`` that
    replacement is a side effect the compiled function does not capture:
    renormalise outside it.  With ``sparse=True``,
    :func:`seqlib.sparse.value_and_grad` gives the weight's gradient as a
    :class:`~seqlib.sparse.SparseGradient` of the looked-up rows only.
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
        """An Embedding whose weight is ``embeddings`` (V, D), frozen unless ``freeze=False``."""
        return cls._wrap(embeddings, freeze, padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)  # fmt: skip

    def __call__(self, input: mx.array) -> mx.array:
        def lookup(table, input, padding_idx):
            return F.embedding(input, table, padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse)

        return self._look_up(lookup, input)


class EmbeddingBag(_Table):
    """Sums, means or maxima of bags of embedding rows, without the (N, D) lookup in between.

    Call as ``bag(input, offsets=None, per_sample_weights=None)``; see
    :func:`seqlib.functional.embedding_bag` for the forms of ``input``.  Options,
    parameter and ``from_pretrained`` as in :class:`Embedding`, plus ``mode``
    (``"sum"``, ``"mean"`` or ``"max"``) and ``include_last_offset``.  A bad ``mode``,
    or ``mode="max"`` with ``sparse`` or ``scale_grad_by_freq``, is refused here at
    construction (torch waits for the first call).
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
        """An EmbeddingBag whose weight is ``embeddings`` (V, D), frozen unless ``freeze=False``."""
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
