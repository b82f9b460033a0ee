"""Optimizers that accept :class:`~seqlib.sparse.SparseGradient`, with torch's update rules.

They are ``mlx.optimizers.Optimizer`` subclasses, used the usual way
(``optimizer.update(model, grads)``).  A dense gradient updates the whole
parameter; a :class:`SparseGradient` touches only its rows, exactly as torch's
``SGD``, ``Adagrad`` and ``SparseAdam`` treat a sparse ``grad``.  Optimizer
state stays dense (as in torch), so memory is the table plus its moments, but
no per-step ``(V, D)`` gradient is ever built.  Note that torch's ``SGD``
momentum differs from ``mlx.optimizers.SGD`` on the first step (torch starts
the buffer at the gradient); these follow torch.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.optimizers as optim

from seqlib.sparse import SparseGradient

__all__ = ["SGD", "Adagrad", "SparseAdam"]


def _rows(gradient: SparseGradient):
    return gradient.indices, gradient.values


class SGD(optim.Optimizer):
    """torch.optim.SGD: ``buf = momentum * buf + (1 - dampening) * g`` (``buf = g`` at first), ``p -= lr * buf``."""

    def __init__(self, learning_rate, momentum: float = 0.0, weight_decay: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False):  # fmt: skip
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening = 0")
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.momentum, self.weight_decay, self.dampening, self.nesterov = momentum, weight_decay, dampening, nesterov

    def init_single(self, parameter, state: dict):
        if self.momentum:
            state["buffer"] = mx.zeros(parameter.shape, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        lr = self.learning_rate.astype(parameter.dtype)
        if isinstance(gradient, SparseGradient):
            if self.weight_decay:
                raise ValueError("weight_decay: must be 0 for a sparse gradient (as in torch), got "
                                 f"{self.weight_decay}")  # fmt: skip
            if not self.momentum:
                rows, values = _rows(gradient)
                return parameter.at[rows].add(-lr * values)
            gradient = gradient.to_dense()  # momentum keeps every row it ever touched moving
        elif self.weight_decay:
            gradient = gradient + self.weight_decay * parameter
        if self.momentum:
            first = self.step == 1
            buffer = mx.where(first, gradient, self.momentum * state["buffer"] + (1 - self.dampening) * gradient)
            state["buffer"] = buffer
            gradient = gradient + self.momentum * buffer if self.nesterov else buffer
        return parameter - lr * gradient


class Adagrad(optim.Optimizer):
    """torch.optim.Adagrad: ``sum += g**2``, ``p -= lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)``."""

    def __init__(self, learning_rate=0.01, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10):  # fmt: skip
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.lr_decay, self.weight_decay, self.eps = lr_decay, weight_decay, eps
        self.initial_accumulator_value = initial_accumulator_value

    def init_single(self, parameter, state: dict):
        state["sum"] = mx.full(parameter.shape, self.initial_accumulator_value, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        step_size = self.learning_rate / (1 + (self.step - 1).astype(mx.float32) * self.lr_decay)
        step_size = step_size.astype(parameter.dtype)
        if isinstance(gradient, SparseGradient):
            if self.weight_decay:
                raise ValueError(f"weight_decay: must be 0 for a sparse gradient (as in torch), got "
                                 f"{self.weight_decay}")  # fmt: skip
            rows, values = _rows(gradient)
            state["sum"] = state["sum"].at[rows].add(values * values)
            std = mx.sqrt(state["sum"][rows]) + self.eps
            return parameter.at[rows].add(-step_size * (values / std))
        if self.weight_decay:
            gradient = gradient + self.weight_decay * parameter
        state["sum"] = state["sum"] + gradient * gradient
        return parameter - step_size * gradient / (mx.sqrt(state["sum"]) + self.eps)


class SparseAdam(optim.Optimizer):
    """torch.optim.SparseAdam: Adam whose moments and step touch only the rows with a gradient."""

    def __init__(self, learning_rate=0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__()
        self._maybe_schedule("learning_rate", learning_rate)
        self.betas, self.eps = betas, eps

    def init_single(self, parameter, state: dict):
        state["exp_avg"] = mx.zeros(parameter.shape, parameter.dtype)
        state["exp_avg_sq"] = mx.zeros(parameter.shape, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        if not isinstance(gradient, SparseGradient):
            raise TypeError(
                "gradient: SparseAdam needs SparseGradient (sparse=True tables with seqlib.sparse.value_and_grad); "
                f"got a dense {type(gradient).__name__}: use an Adam optimizer for dense parameters"
            )
        beta1, beta2 = self.betas
        rows, values = _rows(gradient)
        old_avg, old_avg_sq = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        avg_update = (values - old_avg) * (1 - beta1)
        avg_sq_update = (values * values - old_avg_sq) * (1 - beta2)
        state["exp_avg"] = state["exp_avg"].at[rows].add(avg_update)
        state["exp_avg_sq"] = state["exp_avg_sq"].at[rows].add(avg_sq_update)
        step = self.step.astype(mx.float32)
        step_size = (self.learning_rate * mx.sqrt(1 - beta2**step) / (1 - beta1**step)).astype(parameter.dtype)
        numerator = avg_update + old_avg
        denominator = mx.sqrt(avg_sq_update + old_avg_sq) + self.eps
        return parameter.at[rows].add(-step_size * (numerator / denominator))
