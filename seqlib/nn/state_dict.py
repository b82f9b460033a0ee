"""``load_torch_state_dict`` and ``torch_state_dict``: the layers' weights under torch's ``state_dict()`` keys."""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from seqlib._torch_arrays import to_mlx_array

__all__ = ["TorchStateDictMixin"]


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
