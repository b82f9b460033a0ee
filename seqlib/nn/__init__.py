"""Layers with PyTorch's names, arguments and parameter names, as ``mlx.nn`` modules."""

from seqlib.nn.cells import GRUCell, LSTMCell, RNNCell
from seqlib.nn.embedding import Embedding, EmbeddingBag

__all__ = ["Embedding", "EmbeddingBag", "GRUCell", "LSTMCell", "RNNCell"]
