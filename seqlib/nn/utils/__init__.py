"""Utilities for the layers, as in ``torch.nn.utils``."""

from seqlib.nn.utils import rnn

__all__ = ["rnn"]
