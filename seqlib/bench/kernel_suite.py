"""``python -m seqlib.bench kernels``: seqlib's Metal kernels against its MLX-ops path, on a Mac.

Each case runs the same computation both ways in one interleaved run, after
checking that they agree:

  ops path            the MLX ops seqlib uses where Metal is missing (compiled gate math, take/sum)
  metal               seqlib's fused kernel(s) for the same call
  metal v1 (simple)   lstm_sequence_simple.metal: one thread per hidden unit, uncoalesced W_hh reads
  metal v2 (simd)     lstm_sequence.metal: one SIMD group per unit, coalesced reads + simd_sum

Napkin math is printed with each case: the bytes that must move and the
FLOPs, so the GB/s column can be read against the machine's bandwidth (the
pointwise and bag kernels are memory-bound; the whole-sequence kernel re-reads
W_hh once per sequence and step, 16 H^2 bytes for 8 H^2 FLOPs).

Metal kernels run only on Apple silicon; elsewhere this suite says so and times
nothing, unless ``--emulate`` is given: then the kernels run through
:mod:`seqlib.emulation` on the CPU, which checks every case against the ops path
(the timings then measure the emulation, not a GPU).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import seqlib
from seqlib import kernels, pointwise
from seqlib.bench import Case, print_versions, run_cases

FLOAT = 4
_kernel_backend = "metal"  # or "emulate" (main's --emulate)


def _max_error(reference, other) -> float:
    pairs = zip(reference, other, strict=True) if isinstance(reference, (tuple, list)) else [(reference, other)]
    return max(float(np.abs(np.array(a, np.float64) - np.array(b, np.float64)).max()) for a, b in pairs)


def _evaluated(function):
    def run():
        result = function()
        mx.eval(result)
        return result

    return run


def _on(backend: str, function):
    def run():
        with kernels.use_backend(backend):
            return function()

    return _evaluated(run)


def lstm_cell_case(batch: int, hidden_size: int) -> Case:
    rng = np.random.default_rng(0)
    gates = mx.array(rng.standard_normal((batch, 4 * hidden_size)).astype(np.float32))
    c_prev = mx.array(rng.standard_normal((batch, hidden_size)).astype(np.float32))
    mx.eval(gates, c_prev)
    bytes_moved = FLOAT * batch * hidden_size * (5 + 7)  # read gates + c_prev, write h, c, tanh_c, activations
    return Case(
        name=f"LSTM gate math (one step), B={batch} H={hidden_size}",
        implementations={
            "ops path": _evaluated(lambda: pointwise.lstm_pointwise(gates, c_prev, compiled=True)),
            "metal": _on(_kernel_backend, lambda: kernels.lstm_pointwise(gates, c_prev)),
        },
        bytes_moved=bytes_moved,
        flops=30 * batch * hidden_size,
        check=_max_error,
        tolerance=1e-5,
        notes=[f"napkin: {bytes_moved / 1e6:.2f} MB moved, ~30 FLOPs and 5 transcendentals per unit"],
        mlx_baseline="ops path",
    )


def lstm_layer_case(steps: int, batch: int, input_size: int, hidden_size: int) -> Case:
    layer = seqlib.nn.LSTM(input_size, hidden_size)
    x = mx.random.normal((steps, batch, input_size), key=mx.random.key(0))
    x_gates = mx.addmm(layer.bias_ih_l0 + layer.bias_hh_l0, x.reshape(-1, input_size), layer.weight_ih_l0.T)
    h0 = mx.zeros((batch, hidden_size))
    mx.eval(layer.parameters(), x, x_gates)
    sizes = (batch,) * steps
    implementations = {
        "ops path": _on("ops", lambda: layer(x)[0]),
        "metal": _on(_kernel_backend, lambda: layer(x)[0]),
    }
    if kernels.sequence_kernel_serves(batch, hidden_size):
        for label, version in (("metal v1 (simple)", "simple"), ("metal v2 (simd)", "simd")):
            implementations[label] = _on(
                _kernel_backend,
                lambda version=version: kernels.lstm_sequence_forward(
                    x_gates, layer.weight_hh_l0, h0, h0, sizes, version=version
                )[0].reshape(steps, batch, hidden_size),
            )
    weight_bytes = FLOAT * 4 * hidden_size * hidden_size * steps * batch  # W_hh per sequence and step
    flops = 2 * steps * batch * 4 * hidden_size * (input_size + hidden_size)
    return Case(
        name=f"LSTM layer forward, T={steps} B={batch} D={input_size} H={hidden_size}",
        implementations=implementations,
        bytes_moved=weight_bytes,
        flops=flops,
        check=_max_error,
        tolerance=1e-4,
        notes=[
            f"napkin: {flops / 1e9:.3f} GFLOP; the whole-sequence kernel reads W_hh {steps * batch} times "
            f"({weight_bytes / 1e6:.1f} MB, mostly from cache); the ops path makes {2 * steps} launches or more"
        ],
        mlx_baseline="ops path",
    )


def embedding_bag_case(num_embeddings: int, embedding_dim: int, bags: int, bag_size: int) -> Case:
    rng = np.random.default_rng(0)
    weight = mx.array(rng.standard_normal((num_embeddings, embedding_dim)).astype(np.float32))
    indices = mx.array(rng.integers(0, num_embeddings, bags * bag_size).astype(np.int32))
    offsets = mx.arange(0, bags * bag_size, bag_size)
    mx.eval(weight, indices, offsets)

    def bag():
        return seqlib.functional.embedding_bag(indices, weight, offsets, mode="sum")

    bytes_moved = FLOAT * (bags * bag_size * (embedding_dim + 1) + bags * embedding_dim)
    return Case(
        name=f"EmbeddingBag sum forward, V={num_embeddings} D={embedding_dim} B={bags} bag={bag_size}",
        implementations={"ops path": _on("ops", bag), "metal": _on(_kernel_backend, bag)},
        bytes_moved=bytes_moved,
        check=_max_error,
        tolerance=1e-4,
        notes=[f"napkin: >= {bytes_moved / 1e6:.1f} MB moved (each looked-up row once), 1 FLOP per value"],
        mlx_baseline="ops path",
    )


def main(repeats: int = 15, quick: bool = False, emulate: bool = False) -> None:
    """Run the suite on Metal, or with ``emulate`` through seqlib.emulation (validation; CPU timings)."""
    global _kernel_backend
    print_versions()
    if emulate:
        _kernel_backend = "emulate"
        print("Emulated: the kernels run on the CPU through seqlib.emulation; the timings are not a GPU's.")
    elif not kernels.metal_available():
        print(
            "Metal is not available on this machine, so there is nothing to compare: the kernel-vs-ops "
            "suite needs an Apple-silicon Mac.  (--emulate runs the kernels through seqlib.emulation and "
            "checks them against the ops path; their speed can only be measured on a Mac.)"
        )
        return
    else:
        _kernel_backend = "metal"
    if quick:
        cases = [lstm_cell_case(2, 40), lstm_layer_case(3, 2, 5, 40), embedding_bag_case(50, 8, 4, 3)]
    else:
        cases = [
            lstm_cell_case(32, 512),
            lstm_cell_case(1, 256),
            lstm_layer_case(50, 1, 64, 256),
            lstm_layer_case(100, 8, 128, 256),
            lstm_layer_case(100, 32, 256, 512),
            embedding_bag_case(100_000, 128, 2048, 20),
        ]
    run_cases(cases, repeats=2 if quick else repeats, warmup=1)
