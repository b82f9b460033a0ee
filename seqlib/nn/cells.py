"""``RNNCell``, ``LSTMCell`` and ``GRUCell``: one time step, with PyTorch's parameters and calls.

Each cell holds ``weight_ih`` (G*H, D), ``weight_hh`` (G*H, H) and, with
``bias=True``, ``bias_ih`` and ``bias_hh`` (G*H,), where G is the number of gate
blocks (1 for RNN, 4 for LSTM in the order i, f, g, o, 3 for GRU in the order
r, z, n), all initialised U(-1/sqrt(H), 1/sqrt(H)) as in torch.  One matmul per
side gives every gate's pre-activation at once (the packing trick); the gate
math is that of :mod:`seqlib.reference`'s NumPy cells, run by
:mod:`seqlib.scan` as a sequence of one step.

As in torch, ``input_size`` and ``hidden_size`` may be 0 and a batch may hold
no rows (the outputs are then empty, or for ``input_size=0`` the bias alone
drives the state); input and states must have the cell's dtype (a TypeError:
torch does not promote them either).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from seqlib._checks import check_choice, check_nonnegative_ints
from seqlib.nn.recurrence import GRURecurrence, LSTMRecurrence, RNNRecurrence
from seqlib.nn.state_dict import TorchStateDictMixin

NONLINEARITIES = ("tanh", "relu")


class _Cell(TorchStateDictMixin, nn.Module):
    proj_size = 0  # cells have no projection; the shared LSTM step reads this

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
        super().__init__()
        check_nonnegative_ints(input_size=input_size, hidden_size=hidden_size)  # torch's cells accept 0
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        bound = 1.0 / math.sqrt(hidden_size) if hidden_size > 0 else 0.0  # torch's bound
        rows = self.gate_blocks * hidden_size
        self.weight_ih = mx.random.uniform(-bound, bound, (rows, input_size))
        self.weight_hh = mx.random.uniform(-bound, bound, (rows, hidden_size))
        if bias:
            self.bias_ih = mx.random.uniform(-bound, bound, (rows,))
            self.bias_hh = mx.random.uniform(-bound, bound, (rows,))

    def _extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}" + ("" if self.bias else ", bias=False")

    def _check_input(self, input: mx.array) -> bool:
        """Raise unless input is (B, D) or (D,) of the cell's dtype; return whether it is batched."""
        if not isinstance(input, mx.array):
            raise TypeError(f"input: expected an mlx.core.array, got {type(input).__name__}")
        if input.ndim not in (1, 2) or input.shape[-1] != self.input_size:
            raise ValueError(
                f"input: expected shape (batch, {self.input_size}) or ({self.input_size},), got {tuple(input.shape)}"
            )
        self._check_dtype("input", input, "weight_ih")
        return input.ndim == 2

    def _state(self, state, input: mx.array, batched: bool, name: str) -> mx.array:
        """The given state checked against the input's shape, or zeros."""
        shape = (input.shape[0], self.hidden_size) if batched else (self.hidden_size,)
        if state is None:
            return mx.zeros(shape, input.dtype)
        if not isinstance(state, mx.array):
            raise TypeError(f"{name}: expected an mlx.core.array or None, got {type(state).__name__}")
        if tuple(state.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} to match input {tuple(input.shape)}, "
                             f"got {tuple(state.shape)}")  # fmt: skip
        self._check_dtype(name, state, "weight_hh")
        return state

    def _is_empty(self, input: mx.array) -> bool:
        """Whether the step's outputs hold no element (no rows, or hidden_size 0): nothing to compute."""
        return self.hidden_size == 0 or (input.ndim == 2 and input.shape[0] == 0)

    def _step_one_state(self, input: mx.array, hx: mx.array | None) -> mx.array:
        """One step of a cell whose state is h alone (RNNCell, GRUCell): the new h."""
        batched = self._check_input(input)
        hidden = self._state(hx, input, batched, "hx")
        if self._is_empty(input):
            return mx.zeros(hidden.shape, input.dtype)
        if not batched:
            return self._step_one_state(input[None], hidden[None])[0]
        h, _ = self._run_direction(input, [input.shape[0]], [hidden], "", reverse=False)
        return h

# A cell is a sequence of length one: the same step (and hand-written backward) as the layers,
# with suffix "" for its parameter names.


class RNNCell(RNNRecurrence, _Cell):
    r"""One step of an Elman RNN, torch's ``nn.RNNCell``:

    .. math::

        h' = \tanh(W_{ih} x + b_{ih} + W_{hh} h + b_{hh})

    (:math:`\max(0, \cdot)` instead of :math:`\tanh` with ``nonlinearity="relu"``).  Loop over
    the steps yourself, or use :class:`~seqlib.nn.RNN` for whole sequences.

    Args:
        input_size: D, the number of input features.
        hidden_size: H, the number of hidden units.
        bias: whether the cell has ``bias_ih`` and ``bias_hh``. Default True.
        nonlinearity: ``"tanh"`` or ``"relu"``. Default ``"tanh"``.

    Inputs:
        input: :math:`x`, ``(B, D)``, or ``(D,)`` for one example.
        hx: :math:`h`, ``(B, H)`` (``(H,)``), or None for zeros.

    Outputs:
        h: the new state :math:`h'`, ``(B, H)`` (``(H,)`` for one example).

    Weights:
        weight_ih: :math:`W_{ih}`, ``(H, D)``.
        weight_hh: :math:`W_{hh}`, ``(H, H)``.
        bias_ih: :math:`b_{ih}`, ``(H,)`` (only with ``bias``).
        bias_hh: :math:`b_{hh}`, ``(H,)`` (only with ``bias``).  Every weight starts from
            :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh"):
        check_choice("nonlinearity", nonlinearity, NONLINEARITIES)
        super().__init__(input_size, hidden_size, bias)
        self.nonlinearity = nonlinearity

    def __call__(self, input: mx.array, hx: mx.array | None = None) -> mx.array:
        return self._step_one_state(input, hx)


class LSTMCell(LSTMRecurrence, _Cell):
    r"""One step of an LSTM, torch's ``nn.LSTMCell``:

    .. math::

        \begin{aligned}
        i &= \sigma(W_{ii} x + b_{ii} + W_{hi} h + b_{hi}) \\
        f &= \sigma(W_{if} x + b_{if} + W_{hf} h + b_{hf}) \\
        g &= \tanh(W_{ig} x + b_{ig} + W_{hg} h + b_{hg}) \\
        o &= \sigma(W_{io} x + b_{io} + W_{ho} h + b_{ho}) \\
        c' &= f \odot c + i \odot g \\
        h' &= o \odot \tanh(c')
        \end{aligned}

    The four gates come from one matmul per side with the packed ``(4H, D)`` and ``(4H, H)``
    weights.  Loop over the steps yourself, or use :class:`~seqlib.nn.LSTM` for whole sequences.

    Args:
        input_size: D, the number of input features.
        hidden_size: H, the number of hidden units.
        bias: whether the cell has ``bias_ih`` and ``bias_hh``. Default True.

    Inputs:
        input: :math:`x`, ``(B, D)``, or ``(D,)`` for one example.
        hx: the pair :math:`(h, c)`, each ``(B, H)`` (``(H,)``), or None for zeros.

    Outputs:
        (h, c): the new states :math:`(h', c')`, each ``(B, H)`` (``(H,)`` for one example).

    Weights:
        weight_ih: :math:`W_{ii} | W_{if} | W_{ig} | W_{io}` stacked by rows, ``(4H, D)``.
        weight_hh: :math:`W_{hi} | W_{hf} | W_{hg} | W_{ho}`, ``(4H, H)``.
        bias_ih: :math:`b_{ii} | b_{if} | b_{ig} | b_{io}`, ``(4H,)`` (only with ``bias``).
        bias_hh: :math:`b_{hi} | b_{hf} | b_{hg} | b_{ho}`, ``(4H,)`` (only with ``bias``).  Every
            weight starts from :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def __call__(self, input: mx.array, hx: tuple[mx.array, mx.array] | None = None):
        batched = self._check_input(input)
        if hx is not None and not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            what = f"a {type(hx).__name__} of {len(hx)}" if isinstance(hx, (tuple, list)) else type(hx).__name__
            raise TypeError(f"hx: expected a tuple (h, c) or None, got {what}")
        hidden = self._state(None if hx is None else hx[0], input, batched, "hx[0] (h)")
        cell = self._state(None if hx is None else hx[1], input, batched, "hx[1] (c)")
        if self._is_empty(input):
            return mx.zeros(hidden.shape, input.dtype), mx.zeros(cell.shape, input.dtype)
        if not batched:
            h, c = self(input[None], (hidden[None], cell[None]))
            return h[0], c[0]
        h, _, c = self._run_direction(input, [input.shape[0]], [hidden, cell], "", reverse=False)
        return h, c


class GRUCell(GRURecurrence, _Cell):
    r"""One step of a GRU, torch's ``nn.GRUCell``:

    .. math::

        \begin{aligned}
        r &= \sigma(W_{ir} x + b_{ir} + W_{hr} h + b_{hr}) \\
        z &= \sigma(W_{iz} x + b_{iz} + W_{hz} h + b_{hz}) \\
        n &= \tanh(W_{in} x + b_{in} + r \odot (W_{hn} h + b_{hn})) \\
        h' &= (1 - z) \odot n + z \odot h
        \end{aligned}

    Loop over the steps yourself, or use :class:`~seqlib.nn.GRU` for whole sequences.

    Args:
        input_size: D, the number of input features.
        hidden_size: H, the number of hidden units.
        bias: whether the cell has ``bias_ih`` and ``bias_hh``. Default True.

    Inputs:
        input: :math:`x`, ``(B, D)``, or ``(D,)`` for one example.
        hx: :math:`h`, ``(B, H)`` (``(H,)``), or None for zeros.

    Outputs:
        h: the new state :math:`h'`, ``(B, H)`` (``(H,)`` for one example).

    Weights:
        weight_ih: :math:`W_{ir} | W_{iz} | W_{in}` stacked by rows, ``(3H, D)``.
        weight_hh: :math:`W_{hr} | W_{hz} | W_{hn}`, ``(3H, H)``.
        bias_ih: :math:`b_{ir} | b_{iz} | b_{in}`, ``(3H,)`` (only with ``bias``).
        bias_hh: :math:`b_{hr} | b_{hz} | b_{hn}`, ``(3H,)`` (only with ``bias``).  Every weight
            starts from :math:`\mathcal{U}(-1/\sqrt{H}, 1/\sqrt{H})`, as in torch.
    """

    def __call__(self, input: mx.array, hx: mx.array | None = None) -> mx.array:
        return self._step_one_state(input, hx)
