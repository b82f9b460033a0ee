"""Layers with PyTorch's names, arguments and parameter names, as ``mlx.nn`` modules."""

from seqlib.nn.embedding import Embedding

__all__ = ["Embedding"]
