"""Moving modules and weights between PyTorch, mlx.nn and seqlib.

seqlib's parameters carry torch's ``state_dict()`` names, so a state dict maps
across key by key (:class:`seqlib.nn.state_dict.TorchStateDictMixin`).  torch is
imported lazily, only inside these functions (and only if you pass it torch
objects).  This module sits above the layers: it imports :mod:`seqlib.nn`, never
the other way round.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
from mlx.utils import tree_unflatten

from seqlib import nn
from seqlib._torch_arrays import to_mlx_array, torch_class

__all__ = ["from_mlx", "from_torch", "register_from_torch", "to_mlx", "to_mlx_array"]

_FROM_TORCH = {}  # torch class name -> function(torch_module) -> seqlib module


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
    subclass may compute something else, so it is refused), or a TorchScript
    module scripted from one (``torch.jit.script(nn.LSTMCell(...))``, or a
    sub-module of a loaded ``.jit`` model such as ``model.decoder.rnn``), with
    its weights in memory (not on the meta device).
    """
    name = _torch_nn_name(module)
    if name is None:
        known = ", ".join(f"torch.nn.{known}" for known in sorted(_FROM_TORCH))
        raise TypeError(
            f"module: expected one of {known} (or a TorchScript module scripted from one), "
            f"got {_describe(module)}"
        )
    meta = [key for key, tensor in module.state_dict().items() if tensor.is_meta]
    if meta:
        raise ValueError(
            f"module: its weights {meta} are on the meta device and hold no data; "
            "materialise them first (module.to_empty(device='cpu'), then initialise or load weights)"
        )
    return _FROM_TORCH[name](module)


_SCRIPTED_TORCH_NN = "__torch__.torch.nn.modules."  # how TorchScript names a class it scripted from torch.nn


def _torch_nn_name(module) -> str | None:
    """The torch.nn class ``module`` is (or was scripted from) if seqlib converts it, else None."""
    name = type(module).__name__
    if name in _FROM_TORCH and type(module) is torch_class(f"nn.{name}"):
        return name
    scripted = _scripted_class(module)
    if scripted.startswith(_SCRIPTED_TORCH_NN):
        name = scripted.rpartition(".")[2]
        return name if name in _FROM_TORCH else None
    return None


def _scripted_class(module) -> str:
    """``"__torch__.torch.nn.modules.rnn.LSTMCell"`` for a TorchScript module scripted from nn.LSTMCell, else ""."""
    script_module = torch_class("jit.ScriptModule")
    if script_module is None or not isinstance(module, script_module):
        return ""
    return module._c._type().qualified_name()  # the scripted class, subclasses keep their own name


def _describe(module) -> str:
    scripted = _scripted_class(module)
    if scripted:
        return f"a TorchScript module of class {scripted.removeprefix('__torch__.')}"
    return f"{type(module).__module__}.{type(module).__qualname__}"


# ------------------------------------------------------------------ torch's modules


def _layer_options(module) -> dict:
    return {
        "num_layers": module.num_layers, "bias": module.bias, "batch_first": module.batch_first,
        "dropout": module.dropout, "bidirectional": module.bidirectional,
    }  # fmt: skip


def _layer_from_torch(cls, module, **options):
    with warnings.catch_warnings():  # torch already warned about dropout with one layer
        warnings.simplefilter("ignore", UserWarning)
        layer = cls(module.input_size, module.hidden_size, **_layer_options(module), **options)
    layer.load_torch_state_dict(module.state_dict())
    return layer.train(module.training)


@register_from_torch("RNN")
def _rnn_from_torch(module) -> nn.RNN:
    return _layer_from_torch(nn.RNN, module, nonlinearity=module.nonlinearity)


@register_from_torch("LSTM")
def _lstm_from_torch(module) -> nn.LSTM:
    return _layer_from_torch(nn.LSTM, module, proj_size=module.proj_size)


@register_from_torch("GRU")
def _gru_from_torch(module) -> nn.GRU:
    return _layer_from_torch(nn.GRU, module)


def _cell_from_torch(cls, module, **options):
    cell = cls(module.input_size, module.hidden_size, module.bias, **options)
    cell.load_torch_state_dict(module.state_dict())
    return cell.train(module.training)


@register_from_torch("RNNCell")
def _rnn_cell_from_torch(module) -> nn.RNNCell:
    return _cell_from_torch(nn.RNNCell, module, nonlinearity=module.nonlinearity)


@register_from_torch("LSTMCell")
def _lstm_cell_from_torch(module) -> nn.LSTMCell:
    return _cell_from_torch(nn.LSTMCell, module)


@register_from_torch("GRUCell")
def _gru_cell_from_torch(module) -> nn.GRUCell:
    return _cell_from_torch(nn.GRUCell, module)


_TORCH_DTYPES = {"torch.float32": mx.float32, "torch.float16": mx.float16, "torch.bfloat16": mx.bfloat16}


def _torch_weight(module) -> mx.array:
    """A table's weight in its own dtype where MLX has it (float64 and others become float32)."""
    return to_mlx_array(module.weight, _TORCH_DTYPES.get(str(module.weight.dtype), mx.float32))


@register_from_torch("Embedding")
def _embedding_from_torch(module) -> nn.Embedding:
    return nn.Embedding.from_pretrained(
        _torch_weight(module), freeze=not module.weight.requires_grad, padding_idx=module.padding_idx,
        max_norm=module.max_norm, norm_type=module.norm_type, scale_grad_by_freq=module.scale_grad_by_freq,
        sparse=module.sparse,
    ).train(module.training)  # fmt: skip


@register_from_torch("EmbeddingBag")
def _embedding_bag_from_torch(module) -> nn.EmbeddingBag:
    return nn.EmbeddingBag.from_pretrained(
        _torch_weight(module), freeze=not module.weight.requires_grad, max_norm=module.max_norm,
        norm_type=module.norm_type, scale_grad_by_freq=module.scale_grad_by_freq, mode=module.mode,
        sparse=module.sparse, include_last_offset=module.include_last_offset, padding_idx=module.padding_idx,
    ).train(module.training)  # fmt: skip


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
    layer.load_torch_state_dict(weights)  # checks every shape against the layer's
    return layer


def _shapes(*arrays) -> list:
    return [tuple(array.shape) if isinstance(array, mx.array) else type(array).__name__ for array in arrays]


def to_mlx(layer):
    """The ``mlx.nn`` RNN/LSTM/GRU with the weights of a one-layer, one-direction seqlib layer (biases folded)."""
    import mlx.nn


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
