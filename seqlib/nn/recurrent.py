"""``RNN``, ``LSTM`` and ``GRU`` layers with PyTorch's arguments, shapes and parameter names.

A layer stacks ``num_layers`` recurrences; with ``bidirectional=True`` each
layer runs once forwards and once backwards over the sequence and concatenates
the two outputs.  Layer k > 0 reads layer k-1's output, through dropout when
training.  Parameters are attributes named as in torch's ``state_dict()``::

    weight_ih_l{k}{suffix}  (G*H, input size of layer k)     bias_ih_l{k}{suffix}  (G*H,)
    weight_hh_l{k}{suffix}  (G*H, P)                         bias_hh_l{k}{suffix}  (G*H,)
    weight_hr_l{k}{suffix}  (P, H)     (LSTM with proj_size = P > 0 only)

with suffix ``""`` or ``"_reverse"``, G gate blocks (1, 4 or 3) and P = H unless
projected.  Every direction of every layer is one call of
:mod:`seqlib.scan`: one matmul for the input side of all steps (or, for an
LSTM or GRU whose input is narrow, that product taken inside seqlib's C++
loop), then the step loop with its hand-written backward.

Shapes (torch's): input (T, B, D), or (B, T, D) with ``batch_first``, or
unbatched (T, D), or a :class:`~seqlib.nn.utils.rnn.PackedSequence`.  Output
(T, B, num_directions * P); ``h_n`` (num_layers * num_directions, B, P) and,
for the LSTM, ``c_n`` (num_layers * num_directions, B, H).

Arguments are checked as torch checks them, with seqlib's errors: the input
and every state must have the layer's dtype (a TypeError; torch raises a
ValueError for the input), a batch of 0 sequences gives empty outputs as in
torch, 0 time steps is refused as in torch, and a hand-built PackedSequence
is checked by :func:`~seqlib.nn.utils.rnn.check_packed_sequence` before any
of its indices is used.
"""

from __future__ import annotations

import math
import numbers
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from seqlib import scan
from seqlib._checks import check_choice, check_positive_ints
from seqlib.nn.recurrence import GRURecurrence, LSTMRecurrence, RNNRecurrence
from seqlib.nn.state_dict import TorchStateDictMixin
from seqlib.nn.utils.rnn import PackedSequence, check_packed_sequence

__all__ = ["GRU", "LSTM", "RNN"]


class _RNNBase(TorchStateDictMixin, nn.Module):
    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
    ):
        super().__init__()
        check_positive_ints(input_size=input_size, hidden_size=hidden_size, num_layers=num_layers)
        _check_dropout(dropout, num_layers)
        if not isinstance(proj_size, int) or isinstance(proj_size, bool) or not 0 <= proj_size < hidden_size:
            raise ValueError(f"proj_size: expected an int in [0, hidden_size={hidden_size}), got {proj_size!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, bool(batch_first), float(dropout)
        self.bidirectional, self.proj_size = bool(bidirectional), proj_size
        self.num_directions = 2 if bidirectional else 1
        self._init_parameters()

    @property
    def output_size(self) -> int:
        """The size of h: hidden_size, or proj_size for a projected LSTM."""
        return self.proj_size or self.hidden_size

    def _init_parameters(self) -> None:
        """Create every parameter in torch's order, U(-1/sqrt(H), 1/sqrt(H)) as torch does."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        rows = self.gate_blocks * self.hidden_size
        for layer in range(self.num_layers):
            layer_input = self.input_size if layer == 0 else self.num_directions * self.output_size
            for suffix in self._suffixes(layer):
                shapes = {"weight_ih": (rows, layer_input), "weight_hh": (rows, self.output_size)}
                if self.bias:
                    shapes |= {"bias_ih": (rows,), "bias_hh": (rows,)}
                if self.proj_size:
                    shapes["weight_hr"] = (self.proj_size, self.hidden_size)
                for name, shape in shapes.items():
                    setattr(self, name + suffix, mx.random.uniform(-bound, bound, shape))

    def _suffixes(self, layer: int) -> list[str]:
        return [f"_l{layer}", f"_l{layer}_reverse"][: self.num_directions]

    def _extra_repr(self) -> str:
        options = [f"{self.input_size}, {self.hidden_size}"]
        defaults = {"num_layers": 1, "bias": True, "batch_first": False, "dropout": 0.0,
                    "bidirectional": False, "proj_size": 0}  # fmt: skip
        options += [f"{name}={getattr(self, name)}" for name, default in defaults.items()
                    if getattr(self, name) != default]  # fmt: skip
        return ", ".join(options)

    # ------------------------------------------------------------ the forward pass

    def __call__(self, input, hx=None):
        packed = not isinstance(input, mx.array)
        if packed:
            if not isinstance(input, tuple):  # a PackedSequence is a NamedTuple; anything else is neither
                raise TypeError(
                    f"input: expected an mlx.core.array or a seqlib.nn.utils.rnn.PackedSequence, "
                    f"got {type(input).__name__}"
                )
            input = check_packed_sequence(input)
            rows, batch_sizes = input.data, np.array(input.batch_sizes).tolist()
            self._check_features(rows, "input.data")
            batch_size, batched = batch_sizes[0], True
        else:
            sequence, batched = self._check_input(input)  # (T, B, D)
            steps, batch_size = sequence.shape[:2]
            rows, batch_sizes = sequence.reshape(steps * batch_size, self.input_size), [batch_size] * steps
        states = self._initial_states(hx, batch_size, batched)
        if batch_size == 0:  # torch: empty outputs for an empty batch (and zero gradients)
            return self._empty_outputs(steps, states)
        if packed and input.sorted_indices is not None:  # states are given in the caller's batch order
            states = [state[:, input.sorted_indices] for state in states]
        rows, final_states = self._run_layers(rows, batch_sizes, states)
        if packed and input.unsorted_indices is not None:
            final_states = [state[:, input.unsorted_indices] for state in final_states]
        if not batched:
            final_states = [state[:, 0] for state in final_states]
        final = tuple(final_states) if len(final_states) > 1 else final_states[0]
        if packed:
            return PackedSequence(rows, input.batch_sizes, input.sorted_indices, input.unsorted_indices), final
        output = rows.reshape(len(batch_sizes), batch_size, -1)
        if not batched:
            output = output[:, 0]
        elif self.batch_first:
            output = scan.batch_first(output)
        return output, final

    def step(self, input: mx.array, hx=None):
        """One time step of every layer, for streaming: feed ``x_t`` and the carried state.

        ``layer.step(x_t, hx)`` gives what ``layer(x_t[None], hx)`` gives (``x_t[:, None]`` with
        ``batch_first``) with the time axis dropped, without building a sequence around it.
        Outside ``mx.grad`` (and ``mx.compile``, ``mx.vmap``), in float32 on the CPU where
        :mod:`seqlib.native` is built, the whole stack runs at once in one C++ call and returns
        evaluated arrays: no MLX graph per step (in training mode with ``dropout``, one call per
        layer, with the dropout between them).  Elsewhere, and on the Metal kernels, each layer is
        one compiled step (see :mod:`seqlib.scan`).

        Args:
            input: :math:`x_t`, ``(B, D)``, or ``(D,)`` for one sequence.
            hx: the state carried from the previous step, as for a call: ``h`` (``(h, c)`` for
                the LSTM), each ``(L, B, P)`` (``(L, P)`` unbatched), or None for zeros.

        Returns:
            ``(output, h_n)`` (``(output, (h_n, c_n))`` for the LSTM): output ``(B, P)`` is the
            last layer's new h, and the new states have hx's shapes.  A bidirectional layer
            cannot step (its reverse direction starts at the end of the sequence): a ValueError.
        """
        if self.bidirectional:
            raise ValueError(
                "step: a bidirectional layer cannot run one step at a time (its reverse direction reads the "
                "sequence from its end); call it on the whole sequence"
            )
        if not isinstance(input, mx.array):
            raise TypeError(f"input: expected an mlx.core.array, got {type(input).__name__}")
        self._check_dtype("input", input, "weight_ih_l0")
        if input.ndim not in (1, 2) or input.shape[-1] != self.input_size:
            raise ValueError(
                f"input: expected shape (batch, input_size={self.input_size}) or ({self.input_size},) for one "
                f"step, got {tuple(input.shape)}"
            )
        batched = input.ndim == 2
        rows = input if batched else input[None]  # (B, D)
        batch_size = rows.shape[0]
        states = self._initial_states(hx, batch_size, batched)
        if batch_size == 0:
            output = mx.zeros((0, self.output_size), states[0].dtype)
        else:
            output, states = self._run_layers(rows, [batch_size], states)
        if not batched:
            output, states = output[0], [state[:, 0] for state in states]
        return output, tuple(states) if len(states) > 1 else states[0]

    def _empty_outputs(self, steps: int, states: list[mx.array]):
        """The outputs for a batch of no sequences: (T, 0, dirs * P) (or (0, T, .)) and the empty states."""
        shape = (steps, 0, self.num_directions * self.output_size)
        output = mx.zeros(shape[1::-1] + shape[2:] if self.batch_first else shape, states[0].dtype)
        return output, tuple(states) if len(states) > 1 else states[0]

    def _run_layers(self, rows, batch_sizes, states):
        """rows (N, D) packed; states: per kind (h, and c for the LSTM) a (L * dirs, B, .) array."""
        dropping = self.training and self.dropout > 0 and self.num_layers > 1
        if len(batch_sizes) == 1 and self.num_directions == 1 and not dropping:  # one step, maybe streamed
            stepped = self._step_now(rows, states, [self._suffixes(layer)[0] for layer in range(self.num_layers)])
            if stepped is not None:
                output, *finals = stepped
                return output, finals
        finals = [[] for _ in states]
        for layer in range(self.num_layers):
            if layer > 0 and self.training and self.dropout > 0:
                rows = _dropout(rows, self.dropout)
            outputs = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                index = layer * self.num_directions + direction
                output, *last = self._run_direction(
                    rows, batch_sizes, [state[index] for state in states], suffix, reverse=direction == 1
                )
                outputs.append(output)
                for kind, value in enumerate(last):
                    finals[kind].append(value)
            rows = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
        return rows, [mx.stack(values) for values in finals]

    # ------------------------------------------------------------ argument checks

    def _check_features(self, rows: mx.array, name: str) -> None:
        if rows.ndim != 2 or rows.shape[-1] != self.input_size:
            raise ValueError(
                f"{name}: expected shape (N, input_size={self.input_size}), got {tuple(rows.shape)}"
            )
        self._check_dtype(name, rows, "weight_ih_l0")

    def _check_input(self, input: mx.array) -> tuple[mx.array, bool]:
        """The input as (T, B, D), and whether it was batched."""
        self._check_dtype("input", input, "weight_ih_l0")
        if input.ndim not in (2, 3) or input.shape[-1] != self.input_size:
            layout = "(batch, seq_len, " if self.batch_first else "(seq_len, batch, "
            raise ValueError(
                f"input: expected a 3-D {layout}input_size={self.input_size}) array or an unbatched "
                f"(seq_len, {self.input_size}) one, got shape {tuple(input.shape)}"
            )
        batched = input.ndim == 3
        sequence = input if not batched else (scan.time_major(input) if self.batch_first else input)
        if not batched:
            sequence = sequence[:, None]
        if sequence.shape[0] == 0:  # as torch; a batch of 0 sequences is fine
            raise ValueError(f"input: expected at least one time step, got shape {tuple(input.shape)}")
        return sequence, batched

    def _state_shapes(self, batch_size: int) -> list[tuple[int, ...]]:
        return [(self.num_layers * self.num_directions, batch_size, self.output_size)]

    def _initial_states(self, hx, batch_size: int, batched: bool) -> list[mx.array]:
        """The initial states (h, and c for the LSTM) as (L * dirs, B, .) arrays: hx checked, or zeros."""
        shapes = self._state_shapes(batch_size)
        if hx is None:
            return [mx.zeros(shape, self.weight_ih_l0.dtype) for shape in shapes]
        if len(shapes) == 1:
            given, names = [hx], ["hx (h_0)"]
        elif isinstance(hx, (tuple, list)) and len(hx) == 2:
            given, names = list(hx), ["hx[0] (h_0)", "hx[1] (c_0)"]
        else:
            what = f"a {type(hx).__name__} of {len(hx)}" if isinstance(hx, (tuple, list)) else type(hx).__name__
            raise TypeError(f"hx: expected a tuple (h_0, c_0) or None, got {what}")
        states = []
        for state, shape, name in zip(given, shapes, names, strict=True):
            if not isinstance(state, mx.array):
                raise TypeError(f"{name}: expected an mlx.core.array, got {type(state).__name__}")
            expected = shape if batched else (shape[0], shape[2])
            if tuple(state.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected}, got {tuple(state.shape)}")
            self._check_dtype(name, state, "weight_hh_l0")
            states.append(state if batched else state[:, None])
        return states


def _check_dropout(dropout, num_layers: int) -> None:
    if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
        raise ValueError(f"dropout: expected a probability in [0, 1], got {dropout!r}")
    if dropout > 0 and num_layers == 1:
        warnings.warn(
            f"dropout={dropout} has no effect with num_layers=1: dropout is applied between layers only",
            UserWarning,
            stacklevel=3,
        )


def _dropout(rows: mx.array, probability: float) -> mx.array:
    """Inverted dropout, as torch: zero each element with the given probability, scale the rest by 1/(1-p)."""
    if probability >= 1:
        return mx.zeros_like(rows)
    keep = mx.random.bernoulli(1 - probability, rows.shape)
    return mx.where(keep, rows / (1 - probability), 0).astype(rows.dtype)


class RNN(RNNRecurrence, _RNNBase):
    r"""An Elman RNN over whole sequences, torch's ``nn.RNN``.

    Each layer computes, at every time step t,

    .. math::

        h_t = \tanh(W_{ih} x_t + b_{ih} + W_{hh} h_{t-1} + b_{hh})

    (:math:`\max(0, \cdot)` instead of :math:`\tanh` with ``nonlinearity="relu"``), where
    :math:`x_t` is the input at step t for the first layer and the output :math:`h_t` of the
    layer below for the others, and :math:`h_0` is the initial state (zeros by default).
    Shapes name T steps, B sequences, D input features, H hidden units, L = ``num_layers``
    and ``num_directions`` (2 if ``bidirectional``, else 1).

    Args:
        input_size: D, the number of features of each input step.
        hidden_size: H, the number of hidden units.
        num_layers: L, how many layers are stacked, each reading the one below. Default 1.
        nonlinearity: ``"tanh"`` or ``"relu"``. Default ``"tanh"``.
        bias: whether each layer has ``bias_ih`` and ``bias_hh``. Default True.
        batch_first: input and output as ``(B, T, *)`` instead of ``(T, B, *)``; the states keep
            their layout. Default False.
        dropout: in training mode, the probability of zeroing each element of every layer's
            output but the last one's (inverted dropout, as torch). Default 0.
        bidirectional: add a second direction that reads each sequence backwards; the output
            is the two directions' outputs concatenated. Default False.

    Inputs:
        input: ``(T, B, D)`` (``(B, T, D)`` with ``batch_first``), ``(T, D)`` for one sequence,
            or a :class:`~seqlib.nn.utils.rnn.PackedSequence` of sequences of different lengths.
        hx: the initial state, ``(L * num_directions, B, H)`` (``(L * num_directions, H)`` for
            one sequence), or None for zeros.

    Outputs:
        output: the last layer's :math:`h_t` at every step, ``(T, B, num_directions * H)`` laid
            out as ``input`` (a :class:`~seqlib.nn.utils.rnn.PackedSequence` for a packed input).
        h_n: every layer-direction's final state, ``(L * num_directions, B, H)`` laid out as ``hx``.
            A call returns the pair ``(output, h_n)``.

    Weights:
        weight_ih_l{k}: :math:`W_{ih}` of layer k, ``(H, D)`` for k = 0, ``(H, num_directions * H)``
            above; the second direction's weights end in ``_reverse`` (``weight_ih_l0_reverse``).
        weight_hh_l{k}: :math:`W_{hh}`, ``(H, H)``.
        bias_ih_l{k}: :math:`b_{ih}`, ``(H,)`` (only with ``bias``, like ``bias_hh_l{k}``).
        bias_hh_l{k}: :math:`b_{hh}`, ``(H,)``.  Every weight starts from
            :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
    ):
        check_choice("nonlinearity", nonlinearity, ("tanh", "relu"))
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional)
        self.nonlinearity = nonlinearity


class LSTM(LSTMRecurrence, _RNNBase):
    r"""Long short-term memory over whole sequences, torch's ``nn.LSTM``.

    Each layer computes, at every time step t, four gates from the input and the previous state
    and updates its cell :math:`c_t` and hidden state :math:`h_t`:

    .. math::

        \begin{aligned}
        i_t &= \sigma(W_{ii} x_t + b_{ii} + W_{hi} h_{t-1} + b_{hi}) \\
        f_t &= \sigma(W_{if} x_t + b_{if} + W_{hf} h_{t-1} + b_{hf}) \\
        g_t &= \tanh(W_{ig} x_t + b_{ig} + W_{hg} h_{t-1} + b_{hg}) \\
        o_t &= \sigma(W_{io} x_t + b_{io} + W_{ho} h_{t-1} + b_{ho}) \\
        c_t &= f_t \odot c_{t-1} + i_t \odot g_t \\
        h_t &= o_t \odot \tanh(c_t)
        \end{aligned}

    where :math:`\sigma` is the logistic sigmoid, :math:`\odot` the elementwise product,
    :math:`x_t` the input at step t (for layers above the first, the output :math:`h_t` of the
    layer below) and :math:`h_0, c_0` the initial states (zeros by default).  With
    ``proj_size`` P > 0 the hidden state is projected, :math:`h_t = W_{hr} (o_t \odot \tanh(c_t))`,
    and has P units instead of H.  Shapes name T steps, B sequences, D input features, H hidden
    units, :math:`H_{out}` (P if ``proj_size`` > 0, else H), L = ``num_layers`` and
    ``num_directions`` (2 if ``bidirectional``, else 1).

    Args:
        input_size: D, the number of features of each input step.
        hidden_size: H, the number of hidden units (the size of :math:`c_t`).
        num_layers: L, how many layers are stacked, each reading the one below. Default 1.
        bias: whether each layer has ``bias_ih`` and ``bias_hh``. Default True.
        batch_first: input and output as ``(B, T, *)`` instead of ``(T, B, *)``; the states keep
            their layout. Default False.
        dropout: in training mode, the probability of zeroing each element of every layer's
            output but the last one's (inverted dropout, as torch). Default 0.
        bidirectional: add a second direction that reads each sequence backwards; the output
            is the two directions' outputs concatenated. Default False.
        proj_size: P; if above 0, project :math:`h_t` to P units with ``weight_hr``. Default 0.

    Inputs:
        input: ``(T, B, D)`` (``(B, T, D)`` with ``batch_first``), ``(T, D)`` for one sequence,
            or a :class:`~seqlib.nn.utils.rnn.PackedSequence` of sequences of different lengths.
        hx: the initial states as a pair ``(h_0, c_0)``, ``h_0`` ``(L * num_directions, B, H_out)``
            and ``c_0`` ``(L * num_directions, B, H)`` (without the B axis for one sequence), or
            None for zeros.

    Outputs:
        output: the last layer's :math:`h_t` at every step, ``(T, B, num_directions * H_out)``
            laid out as ``input`` (a :class:`~seqlib.nn.utils.rnn.PackedSequence` for a packed input).
        (h_n, c_n): every layer-direction's final states, laid out as ``hx``.  A call returns
            ``(output, (h_n, c_n))``.

    Weights:
        weight_ih_l{k}: layer k's :math:`W_{ii} | W_{if} | W_{ig} | W_{io}` stacked by rows,
            ``(4H, D)`` for k = 0, ``(4H, num_directions * H_out)`` above; the second direction's
            weights end in ``_reverse`` (``weight_ih_l0_reverse``).
        weight_hh_l{k}: :math:`W_{hi} | W_{hf} | W_{hg} | W_{ho}`, ``(4H, H_out)``.
        bias_ih_l{k}: :math:`b_{ii} | b_{if} | b_{ig} | b_{io}`, ``(4H,)`` (only with ``bias``).
        bias_hh_l{k}: :math:`b_{hi} | b_{hf} | b_{hg} | b_{ho}`, ``(4H,)`` (only with ``bias``).
        weight_hr_l{k}: :math:`W_{hr}`, ``(P, H)``, only with ``proj_size`` > 0.  Every weight
            starts from :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def _state_shapes(self, batch_size: int) -> list[tuple[int, ...]]:
        layers = self.num_layers * self.num_directions
        return [(layers, batch_size, self.output_size), (layers, batch_size, self.hidden_size)]


class GRU(GRURecurrence, _RNNBase):
    r"""A gated recurrent unit over whole sequences, torch's ``nn.GRU``.

    Each layer computes, at every time step t, a reset gate :math:`r_t`, an update gate
    :math:`z_t` and a candidate :math:`n_t`, and mixes the candidate with the previous state:

    .. math::

        \begin{aligned}
        r_t &= \sigma(W_{ir} x_t + b_{ir} + W_{hr} h_{t-1} + b_{hr}) \\
        z_t &= \sigma(W_{iz} x_t + b_{iz} + W_{hz} h_{t-1} + b_{hz}) \\
        n_t &= \tanh(W_{in} x_t + b_{in} + r_t \odot (W_{hn} h_{t-1} + b_{hn})) \\
        h_t &= (1 - z_t) \odot n_t + z_t \odot h_{t-1}
        \end{aligned}

    where :math:`\sigma` is the logistic sigmoid, :math:`\odot` the elementwise product,
    :math:`x_t` the input at step t (for layers above the first, the output :math:`h_t` of the
    layer below) and :math:`h_0` the initial state (zeros by default).  The reset gate multiplies
    :math:`W_{hn} h_{t-1} + b_{hn}` *after* the matmul, as in torch and cuDNN.  Shapes name T steps,
    B sequences, D input features, H hidden units, L = ``num_layers`` and ``num_directions``
    (2 if ``bidirectional``, else 1).

    Args:
        input_size: D, the number of features of each input step.
        hidden_size: H, the number of hidden units.
        num_layers: L, how many layers are stacked, each reading the one below. Default 1.
        bias: whether each layer has ``bias_ih`` and ``bias_hh``. Default True.
        batch_first: input and output as ``(B, T, *)`` instead of ``(T, B, *)``; the states keep
            their layout. Default False.
        dropout: in training mode, the probability of zeroing each element of every layer's
            output but the last one's (inverted dropout, as torch). Default 0.
        bidirectional: add a second direction that reads each sequence backwards; the output
            is the two directions' outputs concatenated. Default False.

    Inputs:
        input: ``(T, B, D)`` (``(B, T, D)`` with ``batch_first``), ``(T, D)`` for one sequence,
            or a :class:`~seqlib.nn.utils.rnn.PackedSequence` of sequences of different lengths.
        hx: the initial state, ``(L * num_directions, B, H)`` (``(L * num_directions, H)`` for
            one sequence), or None for zeros.

    Outputs:
        output: the last layer's :math:`h_t` at every step, ``(T, B, num_directions * H)`` laid
            out as ``input`` (a :class:`~seqlib.nn.utils.rnn.PackedSequence` for a packed input).
        h_n: every layer-direction's final state, ``(L * num_directions, B, H)`` laid out as ``hx``.
            A call returns the pair ``(output, h_n)``.

    Weights:
        weight_ih_l{k}: layer k's :math:`W_{ir} | W_{iz} | W_{in}` stacked by rows, ``(3H, D)``
            for k = 0, ``(3H, num_directions * H)`` above; the second direction's weights end in
            ``_reverse`` (``weight_ih_l0_reverse``).
        weight_hh_l{k}: :math:`W_{hr} | W_{hz} | W_{hn}`, ``(3H, H)``.
        bias_ih_l{k}: :math:`b_{ir} | b_{iz} | b_{in}`, ``(3H,)`` (only with ``bias``).
        bias_hh_l{k}: :math:`b_{hr} | b_{hz} | b_{hn}`, ``(3H,)`` (only with ``bias``).  Every
            weight starts from :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
    ):
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional)
