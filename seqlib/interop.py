"""Moving weights between PyTorch, mlx.nn and seqlib.

seqlib's parameters carry torch's ``state_dict()`` names, so a state dict maps
across key by key.  torch is imported lazily, only inside these functions (and
only if you pass it torch objects).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["TorchStateDictMixin", "from_mlx", "from_torch", "to_mlx", "to_mlx_array"]

_FROM_TORCH = {}  # torch class name -> function(torch_module) -> seqlib module


def to_mlx_array(value, dtype: mx.Dtype | None = None, name: str = "value") -> mx.array:
    """An MLX array from a torch tensor, a NumPy array or an MLX array, cast to ``dtype`` if given.

    Errors name the array as ``name``.  Floating types NumPy lacks (bfloat16, float8)
    go through float32, exactly.  Sparse and quantized tensors are a TypeError (torch's
    ``load_state_dict`` refuses them too), a meta-device tensor (no data) a ValueError.
    """
    if dtype is not None and not isinstance(dtype, mx.Dtype):
        raise TypeError(f"dtype: expected an mlx.core.Dtype or None, got {type(dtype).__name__}")
    tensor_class = _torch_class("Tensor")
    if tensor_class is not None and isinstance(value, tensor_class):
        value = _torch_to_numpy(value, name)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.itemsize > (16 if value.dtype.kind == "c" else 8):
            raise TypeError(f"{name}: NumPy dtype {value.dtype} has no MLX equivalent")
        value = mx.array(value)
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected a torch tensor, NumPy array or MLX array, got {type(value).__name__}")
    return value.astype(dtype) if dtype is not None else value


def _torch_class(path: str) -> type | None:
    """``torch.<path>`` ("Tensor", "nn.LSTM"), or None if torch was never imported (so nothing can be one)."""
    found = sys.modules.get("torch")
    for part in path.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _torch_to_numpy(tensor, name: str) -> np.ndarray:
    import torch

    if tensor.is_meta:
        raise ValueError(
            f"{name}: a meta-device tensor of shape {tuple(tensor.shape)} has no data; "
            "materialise it first (module.to_empty(device='cpu'), then initialise or load weights)"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        kind = "a quantized" if tensor.is_quantized else f"a {tensor.layout}"
        raise TypeError(f"{name}: expected a dense tensor (as torch's load_state_dict does), got {kind} one; "
                        "convert it first (.to_dense(), .dequantize())")  # fmt: skip
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        tensor = tensor.float()  # NumPy has no bfloat16 / float8: float32 holds them exactly
    elif tensor.dtype == torch.complex32:
        tensor = tensor.to(torch.complex64)
    return tensor.numpy()


class TorchStateDictMixin:
    """``load_torch_state_dict`` and ``torch_state_dict`` for modules with torch's parameter names."""

    def load_torch_state_dict(self, state_dict, strict: bool = True):
        """Load torch tensors or NumPy arrays stored under torch's keys; returns ``self``.

        As torch's ``load_state_dict``: every key must name a parameter and (with
        ``strict``) every parameter must be there; shapes must match and values are cast
        to each parameter's dtype.  Nothing is loaded unless everything checks out, and
        one ValueError lists every key and shape that does not (a value that is not an
        array is a TypeError naming its key).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict: expected a mapping of parameter names to tensors, got {type(state_dict).__name__}"
            )
        for key in state_dict:
            if not isinstance(key, str):
                raise TypeError(f"state_dict: keys must be parameter names (str), got {type(key).__name__} {key!r}")
        current = dict(tree_flatten(self.parameters()))
        missing = sorted(set(current) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(current))
        problems = []
        if strict and (missing or unexpected):
            problems.append(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        loaded = []
        for key, value in state_dict.items():
            if key not in current:
                continue
            array = to_mlx_array(value, current[key].dtype, name=f"state_dict[{key!r}]")
            if array.shape != current[key].shape:
                problems.append(
                    f"state_dict[{key!r}]: expected shape {tuple(current[key].shape)}, got {tuple(array.shape)}"
                )
            loaded.append((key, array))
        if problems:
            raise ValueError("; ".join(problems))
        self.update(tree_unflatten(loaded))
        return self

    def torch_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays under torch's keys (bfloat16 comes back as float32)."""
        def as_numpy(array: mx.array) -> np.ndarray:
            return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)

        return {key: as_numpy(value) for key, value in tree_flatten(self.parameters())}


def register_from_torch(torch_class_name: str):
    """Decorator: register how to convert one torch module class (its name in ``torch.nn``)."""
    if not isinstance(torch_class_name, str):
        raise TypeError(f"torch_class_name: expected a torch.nn class's name, got {type(torch_class_name).__name__}")

    def register(convert):
        _FROM_TORCH[torch_class_name] = convert
        return convert

    return register


def from_torch(module):
    """The seqlib module equivalent to a torch module: same options, same weights.

    ``module`` must be exactly one of the torch.nn classes seqlib implements (a
    subclass may compute something else, so it is refused), with its weights in
    memory (not on the meta device).
    """
    name = type(module).__name__
    if name not in _FROM_TORCH or type(module) is not _torch_class(f"nn.{name}"):
        known = ", ".join(f"torch.nn.{known}" for known in sorted(_FROM_TORCH))
        raise TypeError(f"module: expected one of {known}, got {type(module).__module__}.{type(module).__qualname__}")
    meta = [key for key, tensor in module.state_dict().items() if tensor.is_meta]
    if meta:
        raise ValueError(
            f"module: its weights {meta} are on the meta device and hold no data; "
            "materialise them first (module.to_empty(device='cpu'), then initialise or load weights)"
        )
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
    if kind not in _MLX_WEIGHT_NAMES or type(module) is not getattr(mlx.nn, kind):
        raise TypeError(f"module: expected mlx.nn.RNN, mlx.nn.LSTM or mlx.nn.GRU, got {type(module).__qualname__}")
    w_x, w_h = (getattr(module, name) for name in _MLX_WEIGHT_NAMES[kind])
    if not all(isinstance(weight, mx.array) and weight.ndim == 2 for weight in (w_x, w_h)):
        raise ValueError(f"module: expected 2-D weights {_MLX_WEIGHT_NAMES[kind]}, got {_shapes(w_x, w_h)}")
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
    layer.set_dtype(w_x.dtype)
    return layer.load_torch_state_dict(weights)  # checks every shape against the layer's


def _shapes(*arrays) -> list:
    return [tuple(array.shape) if isinstance(array, mx.array) else type(array).__name__ for array in arrays]


def to_mlx(layer):
    """The ``mlx.nn`` RNN/LSTM/GRU with the weights of a one-layer, one-direction seqlib layer (biases folded)."""
    import mlx.nn

    from seqlib import nn

    kind = type(layer).__name__
    if kind not in _MLX_WEIGHT_NAMES or type(layer) is not getattr(nn, kind):
        raise TypeError(f"layer: expected seqlib.nn.RNN, LSTM or GRU, got {type(layer).__qualname__}")
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
