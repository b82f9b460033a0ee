"""``load_torch_state_dict`` and ``torch_state_dict``: the layers' weights under torch's ``state_dict()`` keys.

A sub-model's weights inside a larger model's state dict sit under a prefix
(``"decoder.rnn.weight_ih"``); :func:`sub_state_dict` takes them out with the
prefix removed, ready for ``load_torch_state_dict``::

    cell = seqlib.nn.LSTMCell(128, 128)
    cell.load_torch_state_dict(sub_state_dict(model.state_dict(), "decoder.rnn"))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from seqlib._torch_arrays import to_mlx_array

__all__ = ["IncompatibleKeys", "TorchStateDictMixin", "sub_state_dict"]


class IncompatibleKeys(NamedTuple):
    """What ``load_torch_state_dict`` returns, as torch's ``load_state_dict`` does: the keys that did not match.

    ``missing_keys``: the module's parameters the state dict did not have (kept as they were);
    ``unexpected_keys``: the state dict's keys that name no parameter (ignored).
    """

    #: The module's parameters that the state dict did not have (they keep their values).
    missing_keys: list[str]
    #: The state dict's keys that name no parameter of the module (ignored).
    unexpected_keys: list[str]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return f"IncompatibleKeys(missing_keys={self.missing_keys}, unexpected_keys={self.unexpected_keys})"


def _check_state_dict(state_dict) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict: expected a mapping of parameter names to tensors, got {type(state_dict).__name__}"
        )
    for key in state_dict:
        if not isinstance(key, str):
            raise TypeError(f"state_dict: keys must be parameter names (str), got {type(key).__name__} {key!r}")


def sub_state_dict(state_dict, prefix: str) -> dict:
    """The entries of ``state_dict`` under ``prefix`` (a module path such as ``"decoder.rnn"``), prefix removed.

    ``sub_state_dict({"decoder.rnn.weight_ih": w, "encoder.0.weight": v}, "decoder.rnn")`` is
    ``{"weight_ih": w}``: the state dict of the sub-module ``decoder.rnn``, what its own
    ``state_dict()`` would give.  A ValueError if nothing is under the prefix, listing the
    module paths that are there.
    """
    _check_state_dict(state_dict)
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise TypeError(f"prefix: expected a module path such as 'decoder.rnn', got {prefix!r}")
    start = prefix.rstrip(".") + "."
    found = {key[len(start):]: value for key, value in state_dict.items() if key.startswith(start)}
    if not found:
        paths = sorted({key.rpartition(".")[0] for key in state_dict if "." in key})
        raise ValueError(f"prefix: no key of state_dict starts with {start!r}; its module paths are {paths}")
    return found


class TorchStateDictMixin:
    """``load_torch_state_dict`` and ``torch_state_dict`` for modules with torch's parameter names."""

    def load_torch_state_dict(self, state_dict, strict: bool = True) -> IncompatibleKeys:
        """Load torch tensors or NumPy arrays stored under torch's keys, as torch's ``load_state_dict`` does.

        With ``strict`` (the default) the keys must be exactly the module's parameters;
        with ``strict=False`` the parameters the state dict has are loaded, the others
        keep their values and keys that name no parameter are ignored.  Either way it
        returns torch's pair :class:`IncompatibleKeys` ``(missing_keys, unexpected_keys)``,
        so a partial load can be checked.  Shapes must match whatever ``strict`` says,
        and values are cast to each parameter's dtype.  Nothing is loaded unless
        everything checks out, and one ValueError lists every key and shape that does
        not (a value that is not an array is a TypeError naming its key).  To load a
        sub-module's weights out of a larger model's state dict, see :func:`sub_state_dict`.
        """
        _check_state_dict(state_dict)
        current = dict(tree_flatten(self.parameters()))
        missing = sorted(set(current) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(current))
        problems = []
        if strict and (missing or unexpected):
            hint = _rename_hint(unexpected, missing)
            problems.append(f"state_dict: missing keys {missing}, unexpected keys {unexpected}{hint}")
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
        if loaded:
            self.update(tree_unflatten(loaded))
        return IncompatibleKeys(missing, unexpected)

    def torch_state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as NumPy arrays under torch's keys (bfloat16 comes back as float32)."""
        def as_numpy(array: mx.array) -> np.ndarray:
            return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)

        return {key: as_numpy(value) for key, value in tree_flatten(self.parameters())}


def _rename_hint(unexpected: list[str], missing: list[str]) -> str:
    """A hint where the keys differ only by a layer suffix: a cell's ``bias_hh`` against a layer's ``bias_hh_l0``."""
    renames = [f"{key!r} -> {key + '_l0'!r}" for key in unexpected if f"{key}_l0" in missing]
    renames += [f"{key!r} -> {key[:-3]!r}" for key in unexpected if key.endswith("_l0") and key[:-3] in missing]
    if not renames:
        return ""
    return (f" (a cell's keys and a layer's differ by the suffix _l0: rename {', '.join(renames)}, "
            "or load the cell's weights into a cell)")
