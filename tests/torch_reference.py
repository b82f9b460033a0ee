"""Small helpers shared by the tests that use PyTorch as the oracle."""

import mlx.core as mx
import numpy as np
import torch


def to_numpy(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32) if array.dtype in (mx.bfloat16, mx.float16) else array)


def to_torch(array: mx.array) -> torch.Tensor:
    return torch.from_numpy(to_numpy(array).copy())


def loss_weights(shape, seed: int = 0) -> np.ndarray:
    """Fixed, distinct weights for a scalar loss, so every output element matters."""
    rng = np.random.default_rng(seed)
    return rng.uniform(-1.0, 2.0, size=shape).astype(np.float32)


def assert_close(ours, theirs, rtol=1e-6, atol=1e-6, what=""):
    ours = to_numpy(ours) if isinstance(ours, mx.array) else np.asarray(ours)
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else np.asarray(theirs)
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol, err_msg=what)
