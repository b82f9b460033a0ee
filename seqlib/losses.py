r"""Cross-entropy with PyTorch's signature, fused on the CPU: ``torch.nn.functional.cross_entropy``.

For logits :math:`x` of :math:`C` classes and a target class :math:`t` per row,

.. math::

    \ell = w_t \Big(\log \sum_c e^{x_c} - x_t\Big) \quad\text{(the row's negative log-likelihood)},

with class weights :math:`w` (all 1 by default); rows whose target is ``ignore_index`` count 0 and
drop out of the mean, which divides by :math:`\sum w_t` over the other rows.  With
``label_smoothing`` :math:`\varepsilon` the loss mixes in the uniform target:
:math:`(1 - \varepsilon)\,\ell + \frac{\varepsilon}{C} \sum_c w_c (\log \sum_k e^{x_k} - x_c)`.
Targets may also be class probabilities (the input's shape, floating), as in torch.

Why seqlib has one: on x86 CPUs MLX evaluates ``exp`` one element at a time (about 12 ns an element
with MLX 0.32: time ``mx.eval(mx.exp(x))`` for a million-element ``x``), and
``mlx.nn.losses.cross_entropy`` takes two such passes over the logits, one for the forward's
log-sum-exp and one for the backward's softmax.  Where :mod:`seqlib.dispatch` picks the
``"native"`` path (float32 on MLX's CPU device, on Linux where seqlib's extension is built), the
log-sum-exps, the picked logits and the gradient come from one C++ primitive with a vectorised
``exp`` (``seqlib/native/losses_cpu.cpp``); everywhere else (a Mac, the GPU, other dtypes,
``"plain"`` for ``mx.export_function``) from MLX's ops.
The rest is MLX ops on (N,) arrays.

Under ``mx.compile(shapeless=True)`` the number of rows may change from call to call (the loss, its
mean and its gradient follow them); the number of classes is the traced graph's (the native path
refuses another with a ValueError, as it does targets that no longer match the rows; elsewhere, as any
shape read in Python under ``shapeless=True``, it must not change).
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx
import numpy as np

from seqlib import native
from seqlib.dispatch import path_for
from seqlib.graph import graph_checks, host_values
from seqlib._checks import check_index_range

__all__ = ["REDUCTIONS", "cross_entropy"]

#: The values ``reduction`` takes, as in torch.
REDUCTIONS = ("none", "mean", "sum")


def _check_arguments(input, target, weight, ignore_index, reduction, label_smoothing) -> None:
    """A TypeError or ValueError naming the first argument that is not what torch takes."""
    if not isinstance(input, mx.array) or not mx.issubdtype(input.dtype, mx.floating):
        raise TypeError(f"input: expected a floating mlx.core.array of logits, got {_described(input)}")
    if input.ndim == 0:
        raise ValueError("input: expected logits of shape (C,), (N, C) or (N, C, d1, ...), got a scalar")
    if not isinstance(target, mx.array):
        raise TypeError("target: expected an mlx.core.array of class indices or probabilities, got "
                        f"{_described(target)}")
    if weight is not None and not (isinstance(weight, mx.array) and mx.issubdtype(weight.dtype, mx.floating)
                                   and weight.shape == (_classes(input),)):  # fmt: skip
        raise ValueError(f"weight: expected a floating array of shape ({_classes(input)},), got {_described(weight)}")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(label_smoothing, numbers.Real) or isinstance(label_smoothing, bool) or not (
            0.0 <= label_smoothing <= 1.0):  # fmt: skip
        raise ValueError(f"label_smoothing: expected a number in [0.0, 1.0], got {label_smoothing!r}")


def _described(value) -> str:
    if isinstance(value, mx.array):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def _classes(input: mx.array) -> int:
    """C: the class axis is 1 (0 for one sample of shape (C,))."""
    return input.shape[0] if input.ndim == 1 else input.shape[1]


def _rows(array: mx.array) -> mx.array:
    """(N, C) rows of an input-shaped array, the class axis last: (C,) -> (1, C); (N, C, d...) -> (N d..., C)."""
    if array.ndim == 1:
        return array[None]
    return mx.moveaxis(array, 1, -1).reshape(-1, array.shape[1]) if array.ndim > 2 else array


def _batch_shape(input: mx.array) -> tuple[int, ...]:
    """The target's shape for class indices: the input's without its class axis."""
    return () if input.ndim == 1 else (input.shape[0], *input.shape[2:])


def _row_targets(target: mx.array, classes: int, ignore_index: int, path: str) -> mx.array:
    """(N,) int32 targets for the loss's rows: a class in [0, C), C for ignore_index, -1 for a target outside
    the classes that no check could stop (its row's loss is NaN).  Targets already on the host are checked
    there (an IndexError); lazy or traced ones in the graph where seqlib's checks can run (an error where the
    loss is evaluated)."""
    values = host_values(target)
    if values is not None:
        values = values.reshape(-1).astype(np.int64)
        check_index_range(values[values != ignore_index], classes, "target", "classes")
        return mx.array(np.where(values == ignore_index, classes, values).astype(np.int32))
    flat = target.reshape(-1)
    if flat.dtype not in (mx.int32, mx.int64) or not -(2**31) <= ignore_index < 2**31:
        flat = flat.astype(mx.int64)  # compared with ignore_index exactly (not wrapped into a narrow dtype)
    ignored = flat == ignore_index
    checks = graph_checks(path)
    if checks is not None:
        checked = checks.checked_indices(mx.where(ignored, 0, flat), classes, "target", "classes")
        return mx.where(ignored, classes, checked)
    inside = (flat >= 0) & (flat < classes)
    return mx.where(ignored, classes, mx.where(inside, flat, -1)).astype(mx.int32)


def _nll_and_logsumexp(logits: mx.array, targets: mx.array | None, path: str) -> tuple[mx.array, mx.array]:
    """Each row's negative log-likelihood (0 for an ignored row, target C, and for every row without targets;
    NaN for target -1) and log-sum-exp: logits (N, C), targets (N,) int32 or None -> (N,), (N,)."""
    rows, classes = logits.shape
    if rows == 0 or classes == 0:  # MLX's max refuses an empty axis; no classes: every target ignored, as torch's 0
        return mx.zeros((rows,), logits.dtype), mx.zeros((rows,), logits.dtype)
    if path == "native" and classes < 2**31 - 1:
        return tuple(native.extension().softmax_cross_entropy(logits, targets))
    # max + log sum exp(x - max), as torch's log_softmax: NaN for a row with +inf (mx.logsumexp gives inf)
    most = mx.stop_gradient(logits.max(axis=-1, keepdims=True))  # its own gradient cancels: none taken
    logsumexp = (most + mx.log(mx.exp(logits - most).sum(axis=-1, keepdims=True)))[:, 0]
    if targets is None:
        return mx.zeros_like(logsumexp), logsumexp
    picked = mx.take_along_axis(logits, mx.clip(targets, 0, max(classes - 1, 0))[:, None], axis=-1)[:, 0]
    nll = mx.where(targets == classes, 0.0, mx.where(targets < 0, math.nan, logsumexp - picked))
    return nll.astype(logits.dtype), logsumexp


def _reduced(losses: mx.array, reduction: str, denominator: mx.array, shape) -> mx.array:
    """The (N,) losses reduced: "none" in ``shape``, "sum", or "mean" as their sum over ``denominator``."""
    if reduction == "none":  # (N,) as it is: a shapeless compile may change N
        return losses if len(shape) == 1 else losses.reshape(shape)
    total = losses.sum()
    if reduction == "sum":
        return total
    # nothing counted (all ignored, or no rows): NaN, as in torch, with a zero gradient (not 0 / 0)
    empty = denominator == 0
    return total / mx.where(empty, 1, denominator) + mx.where(empty, math.nan, 0).astype(losses.dtype)


def cross_entropy(input: mx.array, target: mx.array, weight: mx.array | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> mx.array:
    """``torch.nn.functional.cross_entropy``: the cross-entropy between logits and targets (see the module).

    input: logits (C,), (N, C) or (N, C, d1, ...), floating; target: class indices, (), (N,) or
    (N, d1, ...) of an integer dtype, or class probabilities of the input's shape; weight: (C,) or None;
    ignore_index: a target class that counts nothing (class indices only); reduction: "none" (the
    target's shape without the class axis), "mean" or "sum" (scalars); label_smoothing: in [0, 1].
    """
    _check_arguments(input, target, weight, ignore_index, reduction, label_smoothing)
    ignore_index, label_smoothing = int(ignore_index), float(label_smoothing)  # NumPy scalars as Python numbers
    classes, path = _classes(input), path_for(input.dtype)
    logits = _rows(input)  # (N, C)
    if mx.issubdtype(target.dtype, mx.floating):
        return _probability_cross_entropy(input, target, logits, weight, reduction, label_smoothing, path)
    if mx.issubdtype(target.dtype, mx.bool_) or not mx.issubdtype(target.dtype, mx.integer):
        raise TypeError("target: expected class indices of an integer dtype or floating probabilities, got "
                        f"{target.dtype}")
    if target.shape != _batch_shape(input):
        raise ValueError(f"target: expected class indices of shape {_batch_shape(input)} for input of shape "
                         f"{tuple(input.shape)}, got {tuple(target.shape)}")  # fmt: skip
    targets = _row_targets(target, classes, ignore_index, path)  # (N,) int32
    nll, logsumexp = _nll_and_logsumexp(logits, targets, path)
    counted = targets != classes  # not ignored
    if weight is None:
        target_weights = counted.astype(logits.dtype)
        losses = nll
    else:
        target_weights = mx.where(counted, weight[mx.clip(targets, 0, max(classes - 1, 0))], 0.0).astype(logits.dtype)
        losses = target_weights * nll
    if label_smoothing > 0:
        # sum_c w_c (lse - x_c) = (sum_c w_c) lse - x . w; without weights C lse - sum_c x_c
        spread = (weight.sum() * logsumexp - logits @ weight) if weight is not None else (
            classes * logsumexp - logits.sum(axis=-1))  # fmt: skip
        losses = (1 - label_smoothing) * losses + (label_smoothing / classes) * mx.where(counted, spread, 0.0)
    return _reduced(losses, reduction, target_weights.sum(), _batch_shape(input))


def _probability_cross_entropy(input, target, logits, weight, reduction, label_smoothing, path) -> mx.array:
    """Class probabilities as targets: each row's -sum_c w_c p_c log softmax(x)_c; "mean" divides by the rows."""
    if target.shape != input.shape:
        raise ValueError(f"target: expected probabilities of the input's shape {tuple(input.shape)}, "
                         f"got {tuple(target.shape)}")  # fmt: skip
    classes = logits.shape[1]
    probabilities = _rows(target).astype(logits.dtype)
    if label_smoothing > 0:
        probabilities = probabilities * (1 - label_smoothing) + label_smoothing / classes
    if weight is not None:
        probabilities = probabilities * weight
    logsumexp = _nll_and_logsumexp(logits, None, path)[1]  # no targets: the log-sum-exps alone
    losses = logsumexp * probabilities.sum(axis=-1) - (probabilities * logits).sum(axis=-1)
    rows = mx.ones_like(losses).sum()  # counted in the graph: a shapeless compile may change them
    return _reduced(losses, reduction, rows, _batch_shape(input))
