"""The step maths that a cell and each direction of a layer share: the input side and the scan over steps.

:mod:`seqlib.nn.recurrent` (the layers) and :mod:`seqlib.nn.cells` (a sequence of
one step) both build on these mixins; the scan itself is :mod:`seqlib.scan`.
"""

from __future__ import annotations

import mlx.core as mx

from seqlib import native, scan
from seqlib.dispatch import path_for
from seqlib.graph import is_traced

__all__ = ["GRURecurrence", "LSTMRecurrence", "RNNRecurrence", "Recurrence"]


class Recurrence:
    """The step maths that a cell and each direction of a layer share, run by :mod:`seqlib.scan`.

    Parameters are found by name: ``weight_ih{suffix}``, ``weight_hh{suffix}``, ... with suffix
    ``""`` for a cell and ``"_l0"``, ``"_l1_reverse"``, ... for a layer.  ``_run_direction`` takes
    packed rows (N, D) and the initial states (B, .) and returns ``output, h_n`` (``output, h_n, c_n``).
    """

    gate_blocks = 1
    _quantized_from = None  # the QuantizedRecurrent a float copy runs for (set on the copy); found without a miss

    def _check_dtype(self, name: str, array: mx.array, weight_name: str) -> None:
        """Raise a TypeError unless ``array`` has the dtype of the weights (torch does not promote either)."""
        dtype = self[weight_name].dtype  # the parameter itself (getattr would miss first: a Module is a dict)
        if array.dtype != dtype:
            raise TypeError(
                f"{name}: expected dtype {dtype} (the layer's dtype, that of {weight_name}), got {array.dtype}; "
                f"convert it with .astype({dtype}) or the layer with .set_dtype({array.dtype})"
            )

    def _step_now(self, rows, states, suffixes):
        """One step of the directions ``suffixes`` (a cell: ``[""]``; a stack of unidirectional layers:
        ``["_l0", "_l1", ...]``) run at once in :mod:`seqlib.native`, or None where the MLX graph must
        run.  Streaming calls one step at a time, and at batch 1 building and scheduling a graph per
        step costs more than the step.  ``states``: (B, H) each for a cell, (L, B, H) for layers.

        At once: on the ``"native"`` path of :mod:`seqlib.dispatch`, no projection, and nothing traced
        (no gradient to take, not under ``mx.compile`` or ``mx.vmap``).  The step returns evaluated
        arrays, and evaluates its arguments first: the one place a seqlib forward synchronises, by design
        (a stream of single steps), and only outside every transformation.
        """
        if getattr(self, "proj_size", 0) or path_for(rows.dtype) != "native":
            return None
        quantized = self._quantized_from  # the QuantizedRecurrent this float layer runs for, or None
        quantized_weights = quantized.native_step_weights(suffixes) if quantized is not None else None
        if quantized_weights is not None:  # read the packed integers, never the dequantized matrices
            if is_traced(rows, *states, *quantized_weights):
                return None
            return self._native_quantized_step(native.extension(), rows, states, quantized_weights,
                                               quantized.group_size, quantized.bits)  # fmt: skip
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if self.bias else ("weight_ih", "weight_hh")
        weights = []
        for suffix in suffixes:
            layer_weights = [self[name + suffix] for name in names]
            weights += layer_weights + [None] * (4 - len(layer_weights))
        if is_traced(rows, *states, *weights):
            return None
        return self._native_step(native.extension(), rows, states, weights)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        """This layer or cell with its weight matrices quantized by ``mx.quantize``, for inference
        (``mlx.nn.quantize`` calls this): a :class:`~seqlib.nn.QuantizedRecurrent`.  Every matrix's
        in-features must be a multiple of ``group_size``."""
        from seqlib.nn.quantized import QuantizedRecurrent

        return QuantizedRecurrent(self, group_size, bits, mode)

    def _input_side(self, rows, suffix: str, fold_hidden_bias: bool) -> tuple[mx.array, mx.array | None]:
        """``rows @ W_ih.T`` for every row at once, and the bias to add to each of its rows: ``b_ih``
        (+ ``b_hh`` where it can be folded in), or None.  The sequence functions of :mod:`seqlib.scan`
        take the two apart (``input_bias``)."""
        return rows @ getattr(self, "weight_ih" + suffix).T, self._input_bias(suffix, fold_hidden_bias)

    def _input_bias(self, suffix: str, fold_hidden_bias: bool) -> mx.array | None:
        if not self.bias:
            return None
        bias = getattr(self, "bias_ih" + suffix)
        return bias + getattr(self, "bias_hh" + suffix) if fold_hidden_bias else bias


class RNNRecurrence(Recurrence):
    def _native_step(self, extension, rows, states, weights):
        return tuple(extension.rnn_step(rows, states[0], weights, self.nonlinearity == "relu"))

    def _native_quantized_step(self, extension, rows, states, weights, group_size, bits):
        kind = "rnn_relu" if self.nonlinearity == "relu" else "rnn_tanh"
        return tuple(extension.quantized_step(kind, rows, list(states), weights, group_size, bits))

    def _run_direction(self, rows, batch_sizes, states, suffix, reverse):
        stepped = self._step_now(rows, states, [suffix]) if len(batch_sizes) == 1 else None
        if stepped is not None:
            return stepped
        x_gates, input_bias = self._input_side(rows, suffix, fold_hidden_bias=True)
        weight_hh = getattr(self, "weight_hh" + suffix)
        return scan.rnn_sequence(x_gates, weight_hh, states[0], batch_sizes, reverse, self.nonlinearity,
                                 input_bias=input_bias)


class LSTMRecurrence(Recurrence):
    gate_blocks = 4

    def _native_step(self, extension, rows, states, weights):
        return tuple(extension.lstm_step(rows, states[0], states[1], weights))

    def _native_quantized_step(self, extension, rows, states, weights, group_size, bits):
        return tuple(extension.quantized_step("lstm", rows, list(states), weights, group_size, bits))

    def _run_direction(self, rows, batch_sizes, states, suffix, reverse):
        stepped = self._step_now(rows, states, [suffix]) if len(batch_sizes) == 1 else None
        if stepped is not None:
            return stepped
        weight_hh = getattr(self, "weight_hh" + suffix)
        if not self.proj_size:  # the C++ loop may compute the input side itself
            return scan.lstm_input_sequence(rows, getattr(self, "weight_ih" + suffix), weight_hh, states[0],
                                            states[1], batch_sizes, reverse,
                                            input_bias=self._input_bias(suffix, fold_hidden_bias=True))
        x_gates, input_bias = self._input_side(rows, suffix, fold_hidden_bias=True)
        return scan.lstm_sequence(x_gates, weight_hh, states[0], states[1], batch_sizes, reverse,
                                  getattr(self, "weight_hr" + suffix), input_bias=input_bias)


class GRURecurrence(Recurrence):
    gate_blocks = 3

    def _native_step(self, extension, rows, states, weights):
        return tuple(extension.gru_step(rows, states[0], weights))

    def _native_quantized_step(self, extension, rows, states, weights, group_size, bits):
        return tuple(extension.quantized_step("gru", rows, list(states), weights, group_size, bits))

    def _run_direction(self, rows, batch_sizes, states, suffix, reverse):
        stepped = self._step_now(rows, states, [suffix]) if len(batch_sizes) == 1 else None
        if stepped is not None:
            return stepped
        weight_hh = getattr(self, "weight_hh" + suffix)
        bias_hh = getattr(self, "bias_hh" + suffix) if self.bias else mx.zeros((weight_hh.shape[0],), rows.dtype)
        input_bias = self._input_bias(suffix, fold_hidden_bias=False)  # b_hn sits inside r * (...)
        # the C++ loop may compute the input side itself
        return scan.gru_input_sequence(rows, getattr(self, "weight_ih" + suffix), weight_hh, bias_hh, states[0],
                                       batch_sizes, reverse, input_bias=input_bias)
