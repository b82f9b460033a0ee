"""``CrossEntropyLoss``: torch.nn's loss module over :func:`seqlib.losses.cross_entropy`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from seqlib.losses import REDUCTIONS, cross_entropy


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss``: ``loss(input, target)`` is
    ``cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)``.

    The class weights (C,), where given, are held frozen: a loss has nothing to train.
    """

    def __init__(self, weight: mx.array | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if weight is not None:
            self.weight = weight
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.freeze()

    def __call__(self, input: mx.array, target: mx.array) -> mx.array:
        return cross_entropy(input, target, self.get("weight"), self.ignore_index, self.reduction, self.label_smoothing)
