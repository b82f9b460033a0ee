"""``seqlib.nn.Embedding``: torch.nn.Embedding as an ``mlx.nn.Module``."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from seqlib import functional as F
from seqlib._checks import check_max_norm, check_weight, normalize_padding_idx


class Embedding(nn.Module):
    """A lookup table from integer ids to rows of a learned ``weight`` (V, D).

    The single parameter is ``weight``, initialised N(0, 1) like torch's, with the
    ``padding_idx`` row (if any) set to zero.  With ``max_norm`` set, each call
    renormalises the rows it looks up and *replaces* ``self.weight`` with the
    result, so that afterwards ``self.weight`` equals what torch's in-place
    renormalisation leaves.  Under ``mx.compile`` that replacement is a side
    effect the compiled function does not capture: renormalise outside it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        dtype: mx.Dtype = mx.float32,
    ):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                "num_embeddings and embedding_dim: expected positive ints, "
                f"got {num_embeddings} and {embedding_dim}"
            )
        check_max_norm(max_norm, norm_type)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        weight = mx.random.normal((num_embeddings, embedding_dim)).astype(dtype)
        if self.padding_idx is not None:
            weight[self.padding_idx] = 0
        self.weight = weight

    @classmethod
    def from_pretrained(
        cls,
        embeddings: mx.array,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
    ) -> Embedding:
        """An Embedding whose weight is ``embeddings`` (V, D), frozen unless ``freeze=False``."""
        check_weight(embeddings, "embeddings")
        num_embeddings, embedding_dim = embeddings.shape
        module = cls(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, embeddings.dtype)
        module.weight = embeddings  # kept as given: torch leaves the padding row alone here too
        if freeze:
            module.freeze()
        return module

    def _extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            text += f", max_norm={self.max_norm}"
        return text

    def __call__(self, input: mx.array) -> mx.array:
        if self.max_norm is not None:
            self.weight = F.renorm_for_lookup(self.weight, input, self.max_norm, self.norm_type)
        return F.embedding(input, self.weight, self.padding_idx)
