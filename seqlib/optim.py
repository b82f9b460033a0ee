"""Optimizers with torch's update rules: ``SGD``, ``Adagrad`` and ``SparseAdam`` also accept
:class:`~seqlib.sparse.SparseGradient`; ``Adam`` is torch's dense Adam, one C++ pass per parameter on the CPU.

They are ``mlx.optimizers.Optimizer`` subclasses, used the usual way
(``optimizer.update(model, grads)``, also inside ``mx.compile`` of a training step).  A dense gradient
updates the whole parameter; a :class:`SparseGradient` touches only its rows, exactly as torch's
``SGD``, ``Adagrad`` and ``SparseAdam`` treat a sparse ``grad`` (repeated rows
are summed first, as torch coalesces).  Optimizer state stays dense (as in
torch), so memory is the table plus its moments, but no per-step ``(V, D)``
gradient is ever built.  Note that torch's ``SGD`` momentum differs from
``mlx.optimizers.SGD`` on the first step (torch starts the buffer at the
gradient); these follow torch.

The constructors refuse what torch's refuse (a negative learning rate, betas
outside [0, 1), ...), in torch's order, and also NaN, which torch's ``SGD`` lets
through, and flags that are not booleans (torch takes any truthy value).  Each
update checks every gradient against its parameter (same shape, same dtype, a
parameter of that name) and, like torch, counts steps per parameter: a
parameter that first gets a gradient late starts at its own step 1.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from seqlib import native
from seqlib.dispatch import path_for
from seqlib.sparse import SparseGradient

__all__ = ["SGD", "Adagrad", "Adam", "SparseAdam"]


def _real(name: str, value) -> float:
    """``value`` as a float, or a TypeError naming ``name``."""
    if isinstance(value, mx.array) and value.size == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    return float(value)


def _check_range(name: str, value, low: float = 0.0, high: float = math.inf, low_open: bool = False,
                 high_open: bool = False) -> None:  # fmt: skip
    """Raise a ValueError unless ``value`` lies in the interval (NaN never does)."""
    number = _real(name, value)
    above = number > low if low_open else number >= low
    below = number < high if high_open else number <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}: must lie in {interval} (as in torch.optim), got {value!r}")


class _TorchOptimizer(optim.Optimizer):
    """What seqlib's optimizers share: torch's checks of arguments and of each gradient."""

    accepts_dense = True
    accepts_sparse = True
    weight_decay = 0.0

    def __init__(self, learning_rate, positive_learning_rate: bool = False):
        super().__init__()
        if not callable(learning_rate) and not isinstance(learning_rate, mx.array):
            _real("learning_rate", learning_rate)
        self._maybe_schedule("learning_rate", learning_rate)
        if not isinstance(self.learning_rate, mx.array):
            raise TypeError(f"learning_rate: a schedule must return an mlx.core.array (as mlx.optimizers' "
                            f"schedules do), got {type(self.learning_rate).__name__}")  # fmt: skip
        if self.learning_rate.size != 1:
            raise ValueError(f"learning_rate: expected one number, got an array of shape {self.learning_rate.shape}")
        _check_range("learning_rate", self.learning_rate, low_open=positive_learning_rate)

    def update(self, model: nn.Module, gradients: dict):
        """Apply ``gradients`` (a tree like ``model.parameters()``) to ``model``."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an mlx.nn.Module, got {type(model).__name__}")
        super().update(model, gradients)

    def apply_gradients(self, gradients: dict, parameters: dict):
        """Check ``gradients`` against ``parameters`` (names, shapes, dtypes), then apply them."""
        if not isinstance(parameters, (dict, list, tuple)):
            raise TypeError(f"parameters: expected a tree (dict) of parameters, got {type(parameters).__name__}")
        self._check_gradients(gradients, parameters, self.state)
        self.init(gradients)  # state for parameters that get their first gradient now
        return super().apply_gradients(gradients, parameters)

    def _check_gradients(self, gradients, parameters, state, name: str = "") -> None:
        """Walk ``gradients`` with ``parameters`` and ``state``: each gradient must have a parameter and fit it."""
        if isinstance(parameters, mx.array):
            self._check_gradient(name, gradients, parameters)
            return _check_state(name, state, parameters)
        where = f"gradients[{name!r}]" if name else "gradients"
        if isinstance(gradients, dict) and isinstance(parameters, dict):
            items, known = gradients.items(), parameters
            states = state if isinstance(state, dict) else {}
        elif isinstance(gradients, (list, tuple)) and isinstance(parameters, (list, tuple)):
            items, known = enumerate(gradients), range(len(parameters))
            states = dict(enumerate(state)) if isinstance(state, (list, tuple)) else {}
        elif isinstance(parameters, (dict, list, tuple)):
            kind = "dict" if isinstance(parameters, dict) else "list"
            raise TypeError(f"{where}: expected a {kind} of gradients (like the parameters), "
                            f"got {type(gradients).__name__}")  # fmt: skip
        else:
            raise ValueError(f"{where}: the model has no parameter of that name")
        for key, gradient in items:
            child = f"{name}.{key}" if name else str(key)
            if key not in known:
                raise ValueError(f"gradients[{child!r}]: the model has no parameter of that name")
            self._check_gradients(gradient, parameters[key], states.get(key, {}), child)

    def _check_gradient(self, name: str, gradient, parameter) -> None:
        where = f"gradients[{name!r}]"
        if isinstance(gradient, SparseGradient):
            if not self.accepts_sparse:
                raise TypeError(f"{where}: {type(self).__name__} does not take a SparseGradient (as torch's does not); "
                                "use SparseAdam for the sparse tables, with this optimizer for the dense parameters")
            if self.weight_decay:
                raise ValueError(f"weight_decay: must be 0 for the SparseGradient {where} (as in torch), "
                                 f"got {self.weight_decay}")  # fmt: skip
        elif not isinstance(gradient, mx.array):
            raise TypeError(f"{where}: expected an mlx.core.array or a SparseGradient, got {type(gradient).__name__}")
        elif not self.accepts_dense:
            raise TypeError(
                f"{where}: {type(self).__name__} needs SparseGradient (sparse=True tables with "
                "seqlib.sparse.value_and_grad); got a dense mlx.core.array: use an Adam optimizer for dense parameters"
            )
        if tuple(gradient.shape) != tuple(parameter.shape):
            raise ValueError(f"{where}: expected the parameter's shape {tuple(parameter.shape)}, "
                             f"got {tuple(gradient.shape)}")  # fmt: skip
        if gradient.dtype != parameter.dtype:
            raise TypeError(f"{where}: expected the parameter's dtype {parameter.dtype}, got {gradient.dtype}")

    def init_single(self, parameter, state: dict):
        state["step"] = mx.array(0, mx.uint64)

    def _count_step(self, state: dict) -> mx.array:
        """This parameter's step number (1 on its first gradient), as torch's per-parameter ``step``."""
        state["step"] = state["step"] + 1
        return state["step"]


def _check_state(name: str, state, parameter: mx.array) -> None:
    """Raise unless the optimizer's state for ``name`` (if any) was made for a parameter of this shape."""
    for key, value in state.items() if isinstance(state, dict) else ():
        if not isinstance(value, mx.array) or value.ndim == 0:
            continue
        if value.shape != parameter.shape or value.dtype != parameter.dtype:
            raise ValueError(
                f"gradients[{name!r}]: the optimizer's {key!r} state is {tuple(value.shape)} {value.dtype}, the "
                f"parameter {tuple(parameter.shape)} {parameter.dtype}; use a new optimizer for a new or changed model"
            )


def _checked_betas(betas) -> tuple[float, float]:
    """``betas`` as a pair of floats, each in [0, 1), or the error torch's Adam optimizers raise."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        _check_range(f"betas[{index}]", beta, high=1.0, high_open=True)
    return tuple(_real(f"betas[{index}]", beta) for index, beta in enumerate(betas))


def _bias_correction(beta: float, step: mx.array) -> mx.array:
    """1 - beta ** step in float32, as -expm1(step log beta): accurate to a few ulp also where beta ** step is near 1
    (1 - 0.999 ** 1 computed in float32 is off by 1e-5 of itself); torch computes it in float64."""
    if beta == 0:
        return mx.array(1.0)
    return -mx.expm1(step.astype(mx.float32) * math.log(beta))


class SGD(_TorchOptimizer):
    r"""Stochastic gradient descent with momentum, torch's ``optim.SGD``.

    With gradient :math:`g_t` of parameter :math:`p` at its step t (plus
    :math:`\lambda p` with ``weight_decay`` :math:`\lambda`, dense gradients only):

    .. math::

        \begin{aligned}
        b_1 &= g_1, \qquad b_t = \mu\, b_{t-1} + (1 - \tau)\, g_t \\
        p &\leftarrow p - \eta\, b_t \quad (\text{or } p - \eta\,(g_t + \mu\, b_t) \text{ with Nesterov})
        \end{aligned}

    and :math:`p \leftarrow p - \eta\, g_t` without momentum (:math:`\mu = 0`).  The buffer
    starts at :math:`g_1`, as torch's does (``mlx.optimizers.SGD`` starts it at zero).  A
    :class:`~seqlib.sparse.SparseGradient` without momentum updates only its rows.

    Args:
        learning_rate: :math:`\eta`, a number or a schedule (a function of the step).
        momentum: :math:`\mu`. Default 0.
        weight_decay: :math:`\lambda`, the L2 penalty added to dense gradients. Default 0.
        dampening: :math:`\tau`. Default 0.
        nesterov: use Nesterov momentum (needs momentum > 0 and dampening 0). Default False.
    """

    def __init__(self, learning_rate, momentum: float = 0.0, weight_decay: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False):  # fmt: skip
        super().__init__(learning_rate)
        _check_range("momentum", momentum)
        _check_range("weight_decay", weight_decay)
        _real("dampening", dampening)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"nesterov: needs momentum > 0 and dampening = 0 (as in torch), got momentum={momentum}, "
                f"dampening={dampening}"
            )
        self.momentum, self.weight_decay, self.dampening, self.nesterov = momentum, weight_decay, dampening, nesterov

    def init_single(self, parameter, state: dict):
        super().init_single(parameter, state)
        if self.momentum:
            state["buffer"] = mx.zeros(parameter.shape, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        lr = self.learning_rate.astype(parameter.dtype)
        step = self._count_step(state)
        if isinstance(gradient, SparseGradient):
            gradient = gradient.coalesce()
            if not self.momentum:
                return parameter.at[gradient.indices].add(-lr * gradient.values)
            gradient = gradient.to_dense()  # momentum keeps every row it ever touched moving
        elif self.weight_decay:
            gradient = gradient + self.weight_decay * parameter
        if self.momentum:
            buffer = mx.where(step == 1, gradient, self.momentum * state["buffer"] + (1 - self.dampening) * gradient)
            state["buffer"] = buffer
            gradient = gradient + self.momentum * buffer if self.nesterov else buffer
        return parameter - lr * gradient


class Adagrad(_TorchOptimizer):
    r"""Adagrad, torch's ``optim.Adagrad``: a step per coordinate that shrinks with its gradients' history.

    With gradient :math:`g_t` of parameter :math:`p` at its step t (plus :math:`\lambda p` with
    ``weight_decay`` :math:`\lambda`, dense gradients only):

    .. math::

        s_t = s_{t-1} + g_t^2, \qquad
        p \leftarrow p - \frac{\eta}{1 + (t - 1)\,\delta} \cdot \frac{g_t}{\sqrt{s_t} + \epsilon},

    elementwise, with :math:`s_0` = ``initial_accumulator_value``.  A
    :class:`~seqlib.sparse.SparseGradient` updates :math:`s` and :math:`p` only in its rows
    (repeated rows summed first), as torch does with a sparse gradient.

    Args:
        learning_rate: :math:`\eta`. Default 0.01.
        lr_decay: :math:`\delta`. Default 0.
        weight_decay: :math:`\lambda`, the L2 penalty added to dense gradients. Default 0.
        initial_accumulator_value: :math:`s_0`. Default 0.
        eps: :math:`\epsilon`. Default 1e-10.
    """

    def __init__(self, learning_rate=0.01, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10):  # fmt: skip
        super().__init__(learning_rate)
        for name, value in [("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)]:  # fmt: skip
            _check_range(name, value)
        self.lr_decay, self.weight_decay, self.eps = lr_decay, weight_decay, eps
        self.initial_accumulator_value = initial_accumulator_value

    def init_single(self, parameter, state: dict):
        super().init_single(parameter, state)
        state["sum"] = mx.full(parameter.shape, self.initial_accumulator_value, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        step = self._count_step(state)
        step_size = self.learning_rate / (1 + (step - 1).astype(mx.float32) * self.lr_decay)
        step_size = step_size.astype(parameter.dtype)
        if isinstance(gradient, SparseGradient):
            gradient = gradient.coalesce()  # the update is not linear: repeated rows must be summed first
            rows, values = gradient.indices, gradient.values
            state["sum"] = state["sum"].at[rows].add(values * values)
            std = mx.sqrt(state["sum"][rows]) + self.eps
            return parameter.at[rows].add(-step_size * (values / std))
        if self.weight_decay:
            gradient = gradient + self.weight_decay * parameter
        state["sum"] = state["sum"] + gradient * gradient
        return parameter - step_size * gradient / (mx.sqrt(state["sum"]) + self.eps)


class Adam(_TorchOptimizer):
    r"""Adam, torch's ``optim.Adam``: a step per coordinate from running averages of the gradient and its square.

    With gradient :math:`g_t` of parameter :math:`p` at its step t (:math:`-g_t` with ``maximize``,
    plus :math:`\lambda p` with ``weight_decay`` :math:`\lambda`):

    .. math::

        \begin{aligned}
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2 \\
        p &\leftarrow p - \frac{\eta}{1 - \beta_1^t} \cdot
             \frac{m_t}{\sqrt{\hat v_t} / \sqrt{1 - \beta_2^t} + \epsilon}
        \end{aligned}

    elementwise, from :math:`m_0 = v_0 = 0`, with :math:`\hat v_t = v_t`, or with ``amsgrad`` the
    largest :math:`v` so far.  The bias corrections are on, as in torch (``mlx.optimizers.Adam``
    leaves them off by default), and :math:`\epsilon` is added after the square root.

    On MLX's CPU device (float32, where :mod:`seqlib.native` is built) each parameter's update is one
    C++ primitive (on every core from about 19k elements), in the order and roundings of torch's AVX2
    and AVX-512 CPU kernels, the bias corrections in float64 as torch's: the moments equal those of
    torch's default Adam there bit for bit as long as the parameters do (weight decay feeds a
    difference in the parameter back into them); the parameter can differ by an ulp a step (torch's
    square roots are MKL's, which are not correctly rounded, and its learning rate a float64 where
    MLX keeps a float32).  Elsewhere it is MLX ops, the same numbers within float32 rounding.  It works
    under ``mx.compile`` of a training step as ``mlx.optimizers`` do.  A
    :class:`~seqlib.sparse.SparseGradient` is a TypeError, as in torch (use :class:`SparseAdam` for
    sparse tables).

    Args:
        learning_rate: :math:`\eta`, a number or a schedule (a function of the step). Default 0.001.
        betas: :math:`(\beta_1, \beta_2)`, each in [0, 1). Default (0.9, 0.999).
        eps: :math:`\epsilon`. Default 1e-8.
        weight_decay: :math:`\lambda`, the L2 penalty added to the gradients. Default 0.
        amsgrad: normalise by the largest second moment so far. Default False.
        maximize: ascend the objective instead. Default False.
    """

    accepts_sparse = False

    def __init__(self, learning_rate=0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, maximize: bool = False):  # fmt: skip
        super().__init__(learning_rate)
        _check_range("eps", eps)  # in torch's order: learning rate, eps, betas, weight decay
        self.betas, self.eps = _checked_betas(betas), _real("eps", eps)
        _check_range("weight_decay", weight_decay)
        for name, flag in (("amsgrad", amsgrad), ("maximize", maximize)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}: expected True or False, got {flag!r}")
        self.weight_decay = _real("weight_decay", weight_decay)
        self.amsgrad, self.maximize = bool(amsgrad), bool(maximize)

    def init_single(self, parameter, state: dict):
        super().init_single(parameter, state)
        state["exp_avg"] = mx.zeros(parameter.shape, parameter.dtype)
        state["exp_avg_sq"] = mx.zeros(parameter.shape, parameter.dtype)
        if self.amsgrad:
            state["max_exp_avg_sq"] = mx.zeros(parameter.shape, parameter.dtype)

    def _moment_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        beta1, beta2 = self.betas
        step = self._count_step(state)
        learning_rate = self.learning_rate.astype(mx.float32)
        if path_for(parameter.dtype) == "native":  # the bias corrections in float64 there, as torch's
            moments = [state[name] for name in self._moment_names()]
            parameter, *moments = native.extension().adam_update(
                parameter, gradient, moments, step, learning_rate, beta1, beta2, self.eps, self.weight_decay,
                self.amsgrad, self.maximize)  # fmt: skip
            state.update(zip(self._moment_names(), moments, strict=True))
            return parameter
        neg_step_size = -learning_rate / _bias_correction(beta1, step)
        bias_correction2_sqrt = mx.sqrt(_bias_correction(beta2, step))
        return self._update_with_ops(gradient, parameter, state, neg_step_size.astype(parameter.dtype),
                                     bias_correction2_sqrt.astype(parameter.dtype))  # fmt: skip

    def _update_with_ops(self, gradient, parameter, state, neg_step_size, bias_correction2_sqrt):
        """The update in MLX ops, in the native loop's order (optim_cpu.cpp), its fused multiply-adds rounded twice
        (and the bias corrections computed in float32: float64 is the CPU's alone)."""
        beta1, beta2 = self.betas
        if self.maximize:
            gradient = -gradient
        if self.weight_decay:
            gradient = gradient + self.weight_decay * parameter
        weight, exp_avg = np.float32(1 - beta1), state["exp_avg"]  # as torch's lerp takes it: a float32
        if weight < 0.5:
            exp_avg = exp_avg + float(weight) * (gradient - exp_avg)
        else:
            exp_avg = gradient + float(weight - np.float32(1)) * (gradient - exp_avg)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + ((1 - beta2) * gradient) * gradient
        state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
        if self.amsgrad:
            exp_avg_sq = state["max_exp_avg_sq"] = mx.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        denominator = mx.sqrt(exp_avg_sq) / bias_correction2_sqrt + self.eps
        return parameter + (neg_step_size * exp_avg) / denominator


class SparseAdam(_TorchOptimizer):
    r"""Adam for sparse gradients, torch's ``optim.SparseAdam``: moments and step touch only the rows with a gradient.

    For each row r of a :class:`~seqlib.sparse.SparseGradient` (repeated rows summed first),
    with gradient :math:`g` at the parameter's step t:

    .. math::

        \begin{aligned}
        m_r &\leftarrow \beta_1 m_r + (1 - \beta_1)\, g_r \\
        v_r &\leftarrow \beta_2 v_r + (1 - \beta_2)\, g_r^2 \\
        p_r &\leftarrow p_r - \eta\, \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t} \cdot \frac{m_r}{\sqrt{v_r} + \epsilon}
        \end{aligned}

    Rows without a gradient keep their moments and values.  Like torch's, it takes only
    :class:`~seqlib.sparse.SparseGradient` (a dense gradient is a TypeError).

    Args:
        learning_rate: :math:`\eta`, above 0. Default 0.001.
        betas: :math:`(\beta_1, \beta_2)`, each in [0, 1). Default (0.9, 0.999).
        eps: :math:`\epsilon`, above 0. Default 1e-8.
    """

    accepts_dense = False

    def __init__(self, learning_rate=0.001, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(learning_rate, positive_learning_rate=True)
        _check_range("eps", eps, low_open=True)
        self.betas, self.eps = _checked_betas(betas), eps

    def init_single(self, parameter, state: dict):
        super().init_single(parameter, state)
        state["exp_avg"] = mx.zeros(parameter.shape, parameter.dtype)
        state["exp_avg_sq"] = mx.zeros(parameter.shape, parameter.dtype)

    def apply_single(self, gradient, parameter: mx.array, state: dict) -> mx.array:
        beta1, beta2 = self.betas
        step = self._count_step(state).astype(mx.float32)
        gradient = gradient.coalesce()
        rows, values = gradient.indices, gradient.values
        old_avg, old_avg_sq = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        avg_update = (values - old_avg) * (1 - beta1)
        avg_sq_update = (values * values - old_avg_sq) * (1 - beta2)
        state["exp_avg"] = state["exp_avg"].at[rows].add(avg_update)
        state["exp_avg_sq"] = state["exp_avg_sq"].at[rows].add(avg_sq_update)
        step_size = (self.learning_rate * mx.sqrt(1 - beta2**step) / (1 - beta1**step)).astype(parameter.dtype)
        numerator = avg_update + old_avg
        denominator = mx.sqrt(avg_sq_update + old_avg_sq) + self.eps
        return parameter.at[rows].add(-step_size * (numerator / denominator))
