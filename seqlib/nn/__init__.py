"""Layers with PyTorch's names, arguments and parameter names, as ``mlx.nn`` modules."""

from seqlib.nn import utils
from seqlib.nn.cells import GRUCell, LSTMCell, RNNCell
from seqlib.nn.embedding import Embedding, EmbeddingBag
from seqlib.nn.recurrent import GRU, LSTM, RNN

__all__ = ["GRU", "LSTM", "RNN", "Embedding", "EmbeddingBag", "GRUCell", "LSTMCell", "RNNCell", "utils"]
