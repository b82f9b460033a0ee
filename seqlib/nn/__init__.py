"""Layers with PyTorch's names, arguments and parameter names, as ``mlx.nn`` modules."""

from seqlib.nn.embedding import Embedding, EmbeddingBag

__all__ = ["Embedding", "EmbeddingBag"]
