"""``python -m seqlib.bench recurrent``: LSTM and GRU layers against torch and ``mlx.nn``.

For each (T, B, D, H) of the recurrent issue and each of LSTM and GRU, two cases:
the forward pass, and forward + backward (gradients of every weight and of the
input, for the loss ``sum(output * w)``).  Implementations:

  seqlib            seqlib.nn.LSTM / GRU (one input matmul, compiled gate math, hand-written BPTT)
  mlx.nn            mlx.nn.LSTM / GRU with the same weights (a Python loop, autodiff backward)
  torch             torch.nn.LSTM / GRU on the CPU, its default threads (oneDNN for the LSTM)
  torch (1 thread)  the same, single-threaded: the steadier reference at batch 1

Napkin math per case: the matmul FLOPs, ``2 T B G H (D + H)`` forward and about
twice that again backward, and the bytes that must move at least: the recurrent
weights ``G H H`` floats read once per step (they do not stay in cache between
steps at these sizes) plus the input and output sequences.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn
import numpy as np

import seqlib
from seqlib.bench import Case, print_versions, run_cases
from seqlib.interop import to_mlx

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SHAPES = [(100, 32, 256, 512), (35, 20, 650, 650), (200, 64, 128, 128), (50, 1, 64, 256)]
QUICK_SHAPES = [(12, 4, 16, 32), (10, 1, 8, 16)]
GATE_BLOCKS = {"LSTM": 4, "GRU": 3}


def _relative_error(reference, other) -> float:
    reference, other = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    return float(np.abs(reference - other).max() / max(np.abs(reference).max(), 1e-30))


@contextmanager
def _torch_threads(count: int | None):
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _napkin(kind: str, steps: int, batch: int, input_size: int, hidden_size: int, backward: bool):
    gates = GATE_BLOCKS[kind] * hidden_size
    flops = 2 * steps * batch * gates * (input_size + hidden_size)
    weight_bytes = 4 * gates * hidden_size * steps  # W_hh read once per step
    sequence_bytes = 4 * steps * batch * (input_size + hidden_size)
    if backward:
        return 3 * flops, 2 * weight_bytes + 3 * sequence_bytes
    return flops, weight_bytes + sequence_bytes


def _mlx_implementations(layer, x_batch_first, weights, backward: bool):
    """Closures running an MLX module (seqlib's or mlx.nn's): forward output, or d(loss)/d(input)."""
    is_seqlib = isinstance(layer, seqlib.nn.recurrent._RNNBase)

    def output_of(x):
        out = layer(x)  # seqlib: (output, h_n); mlx.nn.LSTM: (hidden, cell); mlx.nn.GRU: hidden
        return out[0] if is_seqlib or isinstance(layer, mlx.nn.LSTM) else out

    def forward():
        out = output_of(x_batch_first)
        mx.eval(out)
        return out

    def loss(parameters, x):
        layer.update(parameters)
        return (output_of(x) * weights).sum()

    def forward_backward():
        parameter_grads, input_grad = mx.grad(loss, argnums=(0, 1))(layer.trainable_parameters(), x_batch_first)
        mx.eval(parameter_grads, input_grad)
        return input_grad

    return forward_backward if backward else forward


def _torch_implementation(layer, x_np, weights_np, backward: bool, threads: int | None):
    import torch

    x = torch.from_numpy(x_np)
    weights = torch.from_numpy(weights_np)

    def forward():
        with _torch_threads(threads), torch.no_grad():
            return layer(x)[0].numpy()

    def forward_backward():
        with _torch_threads(threads):
            layer.zero_grad()
            inputs = x.clone().requires_grad_()
            (layer(inputs)[0] * weights).sum().backward()
            return inputs.grad.numpy()

    return forward_backward if backward else forward


def recurrent_case(kind: str, shape: tuple[int, int, int, int], backward: bool) -> Case:
    steps, batch, input_size, hidden_size = shape
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, steps, input_size)).astype(np.float32)  # batch-first, as mlx.nn
    weights_np = rng.uniform(-1, 1, (batch, steps, hidden_size)).astype(np.float32)
    ours = getattr(seqlib.nn, kind)(input_size, hidden_size, batch_first=True)
    theirs_mlx = to_mlx(ours)
    x, weights = mx.array(x_np), mx.array(weights_np)
    mx.eval(ours.parameters(), theirs_mlx.parameters(), x, weights)
    implementations = {
        "seqlib": _mlx_implementations(ours, x, weights, backward),
        "mlx.nn": _mlx_implementations(theirs_mlx, x, weights, backward),
    }
    if HAVE_TORCH:
        import torch

        layer = getattr(torch.nn, kind)(input_size, hidden_size, batch_first=True)
        layer.load_state_dict({k: torch.from_numpy(v) for k, v in ours.torch_state_dict().items()})
        implementations["torch"] = _torch_implementation(layer, x_np, weights_np, backward, None)
        if batch == 1:
            implementations["torch (1 thread)"] = _torch_implementation(layer, x_np, weights_np, backward, 1)
    flops, bytes_moved = _napkin(kind, *shape, backward)
    what = "forward + backward" if backward else "forward"
    return Case(
        name=f"{kind} {what}, T={steps} B={batch} D={input_size} H={hidden_size}",
        implementations=implementations,
        bytes_moved=bytes_moved,
        flops=flops,
        check=lambda a, b: _relative_error(np.array(a), np.array(b)),
        tolerance=1e-4,
        notes=[f"napkin: {flops / 1e9:.2f} GFLOP of matmuls, >= {bytes_moved / 1e6:.1f} MB moved"],
        mlx_baseline="mlx.nn",
    )


def main(repeats: int = 7, quick: bool = False) -> None:
    print_versions()
    shapes = QUICK_SHAPES if quick else SHAPES
    cases = [recurrent_case(kind, shape, backward) for shape in shapes
             for kind in ("LSTM", "GRU") for backward in (False, True)]  # fmt: skip
    rows = run_cases(cases, repeats=2 if quick else repeats, warmup=1)
    _print_summary(rows)


def _print_summary(rows: list[dict]) -> None:
    print("\nsummary: seqlib's median / torch's median (and / torch single-threaded where timed)")
    for case in dict.fromkeys(row["case"] for row in rows):
        times = {row["implementation"]: row["median_ms"] for row in rows if row["case"] == case}
        line = f"  {case:<58} seqlib {times['seqlib']:9.2f} ms"
        if "torch" in times:
            line += f"   x{times['seqlib'] / times['torch']:.2f} torch"
        if "torch (1 thread)" in times:
            line += f"   x{times['seqlib'] / times['torch (1 thread)']:.2f} torch 1-thread"
        line += f"   x{times['seqlib'] / times['mlx.nn']:.2f} mlx.nn"
        print(line)
