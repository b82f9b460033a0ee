"""Moving weights between PyTorch, mlx.nn and seqlib.

seqlib's parameters carry torch's ``state_dict()`` names, so a state dict maps
across key by key.  torch is imported lazily, only inside these functions (and
only if you pass it torch objects).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["TorchStateDictMixin", "from_mlx", "from_torch", "to_mlx", "to_mlx_array"]

_FROM_TORCH = {}  # torch class name -> function(torch_module) -> seqlib module


def to_mlx_array(value, dtype: mx.Dtype | None = None) -> mx.array:
    """An MLX array from a torch tensor, a NumPy array or an MLX array."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: go through float32, exactly
            value = value.float()
        value = value.numpy()
    if isinstance(value, np.ndarray):
        value = mx.array(value)
    if not isinstance(value, mx.array):
        raise TypeError(f"expected a torch tensor, NumPy array or MLX array, got {type(value).__name__}")
    return value.astype(dtype) if dtype is not None else value


class TorchStateDictMixin:
    """``load_torch_state_dict`` and ``torch_state_dict`` for modules with torch's parameter names."""

    def load_torch_state_dict(self, state_dict, strict: bool = True):
        """Load torch tensors or NumPy arrays stored under torch's keys; returns ``self``."""
        current = dict(tree_flatten(self.parameters()))
        missing = sorted(set(current) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(current))
        if strict and (missing or unexpected):
            raise ValueError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        loaded = []
        for key, value in state_dict.items():
            if key not in current:
                continue
            array = to_mlx_array(value, current[key].dtype)
            if array.shape != current[key].shape:
                raise ValueError(
                    f"state_dict[{key!r}]: expected shape {tuple(current[key].shape)}, got {tuple(array.shape)}"
                )
            loaded.append((key, array))
        self.update(tree_unflatten(loaded))
        return self

    def torch_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays under torch's keys (bfloat16 comes back as float32)."""
        def as_numpy(array: mx.array) -> np.ndarray:
            return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)

        return {key: as_numpy(value) for key, value in tree_flatten(self.parameters())}


def register_from_torch(torch_class_name: str):
    """Decorator: register how to convert one torch module class."""

    def register(convert):
        _FROM_TORCH[torch_class_name] = convert
        return convert

    return register


def from_torch(module):
    """The seqlib module equivalent to a torch module: same options, same weights."""
    name = type(module).__name__
    if name not in _FROM_TORCH or not type(module).__module__.startswith("torch"):
        known = ", ".join(f"torch.nn.{known}" for known in sorted(_FROM_TORCH))
        raise TypeError(f"module: expected one of {known}, got {type(module).__module__}.{name}")
    return _FROM_TORCH[name](module)


# ------------------------------------------------------------------ mlx.nn's recurrent layers
#
# mlx.nn.RNN / LSTM / GRU are one layer, one direction, batch-first, and fold the
# two biases into one: LSTM and RNN keep ``bias = b_ih + b_hh``; GRU keeps
# ``b = b_ih + (b_hr, b_hz, 0)`` and ``bhn = b_hn`` (b_hn must stay apart: it is
# multiplied by r).  Their weights are torch's weight_ih/weight_hh (``Wx``/``Wh``,
# ``Wxh``/``Whh`` for the RNN) with the same gate order.

_MLX_WEIGHT_NAMES = {"RNN": ("Wxh", "Whh"), "LSTM": ("Wx", "Wh"), "GRU": ("Wx", "Wh")}


def from_mlx(module):
    """The seqlib layer (``batch_first=True``, like MLX's) computing what an ``mlx.nn`` RNN/LSTM/GRU computes.

    Note that MLX's layers return every step's hidden state (and, for the LSTM, every cell
    state), where seqlib's return ``output, h_n`` (``output, (h_n, c_n)``) as torch does.
    """
    import mlx.nn

    from seqlib import nn

    kind = type(module).__name__
    if kind not in _MLX_WEIGHT_NAMES or not isinstance(module, mlx.nn.Module):
        raise TypeError(f"module: expected mlx.nn.RNN, mlx.nn.LSTM or mlx.nn.GRU, got {type(module).__name__}")
    w_x, w_h = (getattr(module, name) for name in _MLX_WEIGHT_NAMES[kind])
    hidden_size, input_size = w_h.shape[1], w_x.shape[1]
    bias = "bias" in module or "b" in module
    options = {"bias": bias, "batch_first": True}
    if kind == "RNN":
        options["nonlinearity"] = _mlx_nonlinearity_name(module.nonlinearity)
    layer = getattr(nn, kind)(input_size, hidden_size, **options)
    weights = {"weight_ih_l0": w_x, "weight_hh_l0": w_h}
    if bias and kind == "GRU":
        zeros = mx.zeros((2 * hidden_size,), module.b.dtype)
        weights |= {"bias_ih_l0": module.b, "bias_hh_l0": mx.concatenate([zeros, module.bhn])}
    elif bias:
        weights |= {"bias_ih_l0": module.bias, "bias_hh_l0": mx.zeros_like(module.bias)}
    layer.update(tree_unflatten(list(weights.items())))
    return layer


def to_mlx(layer):
    """The ``mlx.nn`` RNN/LSTM/GRU with the weights of a one-layer, one-direction seqlib layer (biases folded)."""
    import mlx.nn

    kind = type(layer).__name__
    if kind not in _MLX_WEIGHT_NAMES or not type(layer).__module__.startswith("seqlib"):
        raise TypeError(f"layer: expected seqlib.nn.RNN, LSTM or GRU, got {type(layer).__name__}")
    if layer.num_layers != 1 or layer.bidirectional or getattr(layer, "proj_size", 0):
        raise ValueError(
            f"layer: mlx.nn.{kind} has one layer, one direction and no projection; got num_layers="
            f"{layer.num_layers}, bidirectional={layer.bidirectional}, proj_size={getattr(layer, 'proj_size', 0)}"
        )
    options = {"bias": layer.bias}
    if kind == "RNN":
        options["nonlinearity"] = mlx.nn.relu if layer.nonlinearity == "relu" else mlx.nn.tanh
    module = getattr(mlx.nn, kind)(layer.input_size, layer.hidden_size, **options)
    w_x, w_h = _MLX_WEIGHT_NAMES[kind]
    weights = {w_x: layer.weight_ih_l0, w_h: layer.weight_hh_l0}
    if layer.bias and kind == "GRU":
        hidden_size = layer.hidden_size
        folded = layer.bias_ih_l0 + mx.concatenate([layer.bias_hh_l0[: 2 * hidden_size], mx.zeros((hidden_size,))])
        weights |= {"b": folded, "bhn": layer.bias_hh_l0[2 * hidden_size :]}
    elif layer.bias:
        weights["bias"] = layer.bias_ih_l0 + layer.bias_hh_l0
    module.update(tree_unflatten(list(weights.items())))
    return module


def _mlx_nonlinearity_name(function) -> str:
    import mlx.nn

    if function in (mlx.nn.tanh, mx.tanh):
        return "tanh"
    if function in (mlx.nn.relu,):
        return "relu"
    raise ValueError(f"module.nonlinearity: seqlib's RNN supports tanh and relu, got {function!r}")
