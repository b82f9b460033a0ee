"""Arrays from torch, NumPy or MLX, without importing torch: what the layers and the converters share."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np

__all__ = ["to_mlx_array", "torch_class", "torch_to_numpy"]


def to_mlx_array(value, dtype: mx.Dtype | None = None, name: str = "value") -> mx.array:
    """An MLX array from a torch tensor, a NumPy array or an MLX array, cast to ``dtype`` if given.

    Errors name the array as ``name``.  Floating types NumPy lacks (bfloat16, float8)
    go through float32, exactly.  Sparse and quantized tensors are a TypeError (torch's
    ``load_state_dict`` refuses them too), a meta-device tensor (no data) a ValueError.
    """
    if dtype is not None and not isinstance(dtype, mx.Dtype):
        raise TypeError(f"dtype: expected an mlx.core.Dtype or None, got {type(dtype).__name__}")
    tensor_class = torch_class("Tensor")
    if tensor_class is not None and isinstance(value, tensor_class):
        value = torch_to_numpy(value, name)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.itemsize > (16 if value.dtype.kind == "c" else 8):
            raise TypeError(f"{name}: NumPy dtype {value.dtype} has no MLX equivalent")
        value = mx.array(value)
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected a torch tensor, NumPy array or MLX array, got {type(value).__name__}")
    return value.astype(dtype) if dtype is not None else value


def torch_class(path: str) -> type | None:
    """``torch.<path>`` ("Tensor", "nn.LSTM"), or None if torch was never imported (so nothing can be one)."""
    found = sys.modules.get("torch")
    for part in path.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def torch_to_numpy(tensor, name: str) -> np.ndarray:
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
