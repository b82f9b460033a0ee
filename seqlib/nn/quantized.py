"""Quantized tables and recurrent layers for inference: what ``mlx.nn.quantize`` makes of seqlib's modules.

``mlx.nn.quantize(model)`` replaces every module that has a ``to_quantized`` method by what that
method returns; :class:`seqlib.nn.Embedding` and :class:`seqlib.nn.EmbeddingBag` return these.  Each
stores its (V, D) table as ``mx.quantize`` does (``weight`` packed to ``bits`` bits, ``scales`` and
``biases`` per group of ``group_size`` columns) and dequantizes only the rows a call reads, so a table
of V rows costs about ``V D bits / 8`` bytes plus the scales instead of ``4 V D``.  Indices are checked
as the float tables check them (:mod:`seqlib.functional`).  The tables are frozen: quantized weights
are for inference, as with ``mlx.nn.QuantizedEmbedding`` and torch's dynamic quantization.
"""

from __future__ import annotations

import copy
import operator

import mlx.core as mx
import mlx.nn as nn

from seqlib import functional as F

__all__ = ["QuantizedEmbedding", "QuantizedEmbeddingBag", "QuantizedRecurrent"]


class _QuantizedTable(nn.Module):
    """The quantized ``weight``, ``scales`` and ``biases`` of a (V, D) table, and how they were made."""

    def __init__(self, table, group_size: int, bits: int, mode: str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.weight.shape
        self.padding_idx = table.padding_idx
        self.group_size, self.bits, self.quantization_mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(table.weight, group_size, bits, mode=mode)
        self.biases = biases[0] if biases else None
        self.freeze()

    def dequantized(self) -> mx.array:
        """The whole table as ``mx.dequantize`` gives it back: (V, D), in the scales' dtype."""
        return mx.dequantize(self.weight, self.scales, self.get("biases"), group_size=self.group_size,
                             bits=self.bits, mode=self.quantization_mode)  # fmt: skip

    def _extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}, bits={self.bits}, "
                f"mode={self.quantization_mode!r}")  # fmt: skip


class QuantizedEmbedding(_QuantizedTable):
    r""":class:`seqlib.nn.Embedding` with its table quantized: ``out[..., :] = dequantize(W)[input[...], :]``.

    Made by ``Embedding.to_quantized`` (and so by ``mlx.nn.quantize``); only the looked-up rows are
    dequantized.  Inputs and outputs as :class:`seqlib.nn.Embedding`: ids of any shape ``(*)`` in
    ``[0, V)``, rows ``(*, D)``.  ``padding_idx`` is kept for reference (it only ever stopped gradients).

    Args:
        table: the :class:`~seqlib.nn.Embedding` to quantize (its ``max_norm`` must be None: a frozen
            table is not renormalised).
        group_size: columns that share a scale and a bias (D must be a multiple). Default 64.
        bits: bits per weight, 2 to 8. Default 4.
        mode: ``mx.quantize``'s mode. Default ``"affine"``.
    """

    def __call__(self, input) -> mx.array:
        return F.quantized_embedding(input, self.weight, self.scales, self.get("biases"), self.group_size, self.bits,
                                     self.quantization_mode)  # fmt: skip

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ dequantize(W).T``, (*, D) -> (*, V), as a quantized matmul: for an output layer tied to the table."""
        return mx.quantized_matmul(x, self.weight, self.scales, self.get("biases"), transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.quantization_mode)  # fmt: skip


class QuantizedEmbeddingBag(_QuantizedTable):
    r""":class:`seqlib.nn.EmbeddingBag` with its table quantized: sums, means or maxima of dequantized rows.

    Made by ``EmbeddingBag.to_quantized`` (and so by ``mlx.nn.quantize``).  Inputs and outputs as
    :class:`seqlib.nn.EmbeddingBag`: ``input`` (B, N) or (N,) with ``offsets``, ``per_sample_weights``
    in ``mode="sum"``; one row per bag, (B, D).  Each entry's row is dequantized, (N, D), and pooled by
    :func:`seqlib.functional.pool_rows`.

    Args:
        table: the :class:`~seqlib.nn.EmbeddingBag` to quantize (``max_norm`` None).
        group_size, bits, mode: as :class:`QuantizedEmbedding`.
    """

    def __init__(self, table, group_size: int, bits: int, mode: str):
        super().__init__(table, group_size, bits, mode)
        self.mode = table.mode
        self.include_last_offset = table.include_last_offset

    def __call__(self, input, offsets=None, per_sample_weights=None) -> mx.array:
        return F.quantized_embedding_bag(
            input, self.weight, self.scales, self.get("biases"), self.group_size, self.bits, self.quantization_mode,
            offsets, self.mode, per_sample_weights, self.include_last_offset, self.padding_idx,
        )  # fmt: skip

    def _extra_repr(self) -> str:
        return super()._extra_repr() + f", bag mode={self.mode!r}"


class QuantizedRecurrent(nn.Module):
    r"""A recurrent layer or cell of seqlib with its weight matrices quantized, for inference.

    Made by ``to_quantized`` on :class:`~seqlib.nn.RNN`, :class:`~seqlib.nn.LSTM`, :class:`~seqlib.nn.GRU`
    and the cells (and so by ``mlx.nn.quantize``), the counterpart of torch's dynamically quantized
    LSTM: every weight matrix (``weight_ih*``, ``weight_hh*``, ``weight_hr*``) is stored as
    ``mx.quantize`` gives it, ``{name}`` (packed), ``{name}_scales`` and ``{name}_biases``, so its
    stored parameters take about ``bits / 32`` of the float layer's; the bias vectors stay as they were.
    A call runs the float layer's computation on the dequantized matrices (dequantized by the first
    call that reads them and kept, with that float memory, until the stored arrays are replaced), so
    it computes exactly what the float layer computes with the dequantized weights (:meth:`dequantized`),
    on every path (the C++ primitives, the Metal kernels, MLX ops) and under every transformation.
    Inputs, outputs and ``step`` as the float module's.  One exception, for
    speed: a single step outside every transformation on seqlib's C++ primitives (a streaming cell call
    or ``step``, 4 or 8 bits, ``"affine"``) reads the packed integers directly, never forming the float
    matrices, which a step at batch 1 spends its time reading; it computes the same sums in another
    order (within float32 rounding of the dequantized layer's).

    Args:
        module: the float layer or cell to quantize (its in-features, ``input_size``, ``hidden_size``
            and ``proj_size`` where there is one, must be multiples of ``group_size``).
        group_size: columns that share a scale and a bias. Default 64.
        bits: bits per weight, 2 to 8. Default 4.
        mode: ``mx.quantize``'s mode. Default ``"affine"``.
    """

    def __init__(self, module, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        super().__init__()
        matrices = {name: value for name, value in module.parameters().items()
                    if name.startswith("weight_") and value.ndim == 2}  # fmt: skip
        for name, value in matrices.items():
            if value.shape[1] % group_size:
                raise ValueError(f"group_size: {name} has {value.shape[1]} columns, not a multiple of {group_size}")
        self.group_size, self.bits, self.quantization_mode = group_size, bits, mode
        object.__setattr__(self, "matrix_names", tuple(sorted(matrices)))  # not a parameter
        for name, value in module.parameters().items():
            if name in matrices:
                packed, scales, *biases = mx.quantize(value, group_size, bits, mode=mode)
                self[name], self[name + "_scales"] = packed, scales
                if biases:
                    self[name + "_biases"] = biases[0]
            else:
                self[name] = value
        float_module = copy.copy(module)  # runs the computation; kept outside the parameter tree
        float_module.eval()
        object.__setattr__(self, "_float_module", float_module)
        object.__setattr__(float_module, "_quantized_from", self)  # its single steps read the packed weights
        self.freeze()

    def native_step_weights(self, suffixes) -> tuple | None:
        """What seqlib.native's ``quantized_step`` reads for the directions ``suffixes`` (a cell: ``[""]``):
        per direction ``weight_ih``'s packed values, scales and biases, ``weight_hh``'s, then ``bias_ih``
        and ``bias_hh`` (or None); None where it cannot read this quantization (it reads ``"affine"``
        with 4 or 8 bits in groups of a multiple of 16 columns, float32 scales), and a single step
        dequantizes the matrices as every other call does.  A tuple, kept until a stored array is replaced."""
        self._float()  # the stored arrays checked: the tuples below are kept until one is replaced
        key = tuple(suffixes)
        if key not in self._step_weights:
            self._step_weights[key] = self._read_step_weights(key)
        return self._step_weights[key]

    def _read_step_weights(self, suffixes) -> tuple | None:
        if self.quantization_mode != "affine" or self.bits not in (4, 8) or self.group_size % 16:
            return None
        weights = []
        for suffix in suffixes:
            for name in ("weight_ih" + suffix, "weight_hh" + suffix):
                if self[name + "_scales"].dtype != mx.float32:
                    return None
                weights += [self[name], self[name + "_scales"], self[name + "_biases"]]
            weights += [self.get("bias_ih" + suffix), self.get("bias_hh" + suffix)]
        return tuple(weights)

    def dequantized(self) -> dict:
        """The float parameters the calls compute with: the matrices dequantized, the biases as stored."""
        weights = {}
        for name in self.matrix_names:
            weights[name] = mx.dequantize(self[name], self[name + "_scales"], self.get(name + "_biases"),
                                          group_size=self.group_size, bits=self.bits,
                                          mode=self.quantization_mode)  # fmt: skip
        for name, value in self.parameters().items():
            if name not in self.matrix_names and not name.endswith(("_scales", "_biases")):
                weights[name] = value  # the float biases
        return weights

    def _float(self):
        """The float module on the dequantized weights: built once per set of stored arrays (MLX computes the
        dequantization only where a call reads the matrices; a native single step never does), again when
        an array was replaced (``update``, ``load_weights``)."""
        stored = list(self.values())  # its arrays, all at the top
        built_from = getattr(self, "_dequantized_from", None)
        unchanged = built_from is not None and len(built_from) == len(stored) and all(map(operator.is_, built_from,
                                                                                          stored))  # fmt: skip
        if not unchanged:
            self._float_module.update(self.dequantized())
            object.__setattr__(self, "_dequantized_from", stored)  # held, so that no id is reused meanwhile
            object.__setattr__(self, "_step_weights", {})  # native_step_weights' tuples, per tuple of suffixes
        return self._float_module

    def __call__(self, *args, **kwargs):
        return self._float()(*args, **kwargs)

    def step(self, *args, **kwargs):
        """One time step, as the float layer's ``step`` (layers only)."""
        return self._float().step(*args, **kwargs)

    def _extra_repr(self) -> str:
        return (f"{type(self._float_module).__name__}({self._float_module._extra_repr()}), "
                f"group_size={self.group_size}, bits={self.bits}, mode={self.quantization_mode!r}")  # fmt: skip
