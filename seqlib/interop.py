"""Moving weights between PyTorch and seqlib.

seqlib's parameters carry torch's ``state_dict()`` names, so a state dict maps
across key by key.  torch is imported lazily, only inside these functions (and
only if you pass it torch objects).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["TorchStateDictMixin", "from_torch", "to_mlx_array"]

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
