"""Layers (and a loss) with PyTorch's names, arguments and parameter names, as ``mlx.nn`` modules."""

from seqlib.nn import utils
from seqlib.nn.cells import GRUCell, LSTMCell, RNNCell
from seqlib.nn.embedding import Embedding, EmbeddingBag
from seqlib.nn.losses import CrossEntropyLoss
from seqlib.nn.quantized import QuantizedEmbedding, QuantizedEmbeddingBag, QuantizedRecurrent
from seqlib.nn.recurrent import GRU, LSTM, RNN
from seqlib.nn.state_dict import IncompatibleKeys, sub_state_dict

__all__ = [
    "GRU", "LSTM", "RNN", "CrossEntropyLoss", "Embedding", "EmbeddingBag", "GRUCell", "IncompatibleKeys", "LSTMCell",
    "QuantizedEmbedding", "QuantizedEmbeddingBag", "QuantizedRecurrent", "RNNCell", "sub_state_dict", "utils",
]  # fmt: skip
