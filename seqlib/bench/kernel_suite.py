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

:func:`napkin` holds the napkin math of every kernel in one place (bytes that
must move, FLOPs, arithmetic intensity) as a function of the sizes, for
roofline plots and for predicting a kernel's time on a given chip.

Metal kernels run only on Apple silicon; elsewhere this suite says so and times
nothing, unless ``--emulate`` is given: then the kernels run through
:mod:`seqlib.emulation` on the CPU, which checks every case against the ops path
(the timings then measure the emulation, not a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import seqlib
from seqlib import kernels, pointwise
from seqlib.bench import Case, print_versions, run_cases

FLOAT = 4
_kernel_backend = "metal"  # or "emulate" (main's --emulate)


@dataclass(frozen=True)
class Napkin:
    """A kernel's napkin math at one size: the bytes it must move at least and its FLOPs."""

    kernel: str
    bytes_moved: int
    flops: int

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte of memory traffic."""
        return self.flops / self.bytes_moved

    def seconds(self, bandwidth: float, flop_rate: float | None = None) -> float:
        """The roofline's time: ``bytes / bandwidth`` or ``flops / flop_rate``, whichever is longer
        (``bandwidth`` in bytes/s, ``flop_rate`` in FLOP/s; None: memory only)."""
        memory = self.bytes_moved / bandwidth
        return memory if flop_rate is None else max(memory, self.flops / flop_rate)


def _cell_napkin(values_read: int, values_written: int, flops_per_unit: int):
    def napkin_of(batch: int = 1, hidden_size: int = 256) -> tuple[int, int]:
        units = batch * hidden_size
        return FLOAT * units * (values_read + values_written), flops_per_unit * units

    return napkin_of


def _sequence_napkin(gate_blocks: int, values_written: int, flops_per_unit: int):
    def napkin_of(steps: int = 1, batch: int = 1, hidden_size: int = 256) -> tuple[int, int]:
        gates = gate_blocks * hidden_size  # W_hh is (gates, H), re-read by every sequence at every step
        per_step = FLOAT * (gates * hidden_size + gates + values_written * hidden_size)
        return steps * batch * per_step, steps * batch * (2 * gates * hidden_size + flops_per_unit * hidden_size)

    return napkin_of


def _gather(lookups: int = 1, embedding_dim: int = 128) -> tuple[int, int]:
    return FLOAT * (2 * lookups * embedding_dim + lookups), 0  # read a row, write it; one index per row


def _scatter_add(lookups: int = 1, embedding_dim: int = 128) -> tuple[int, int]:
    values = lookups * embedding_dim  # read d_out, read-modify-write d_weight: one add each
    return FLOAT * (3 * values + lookups), values


def _bag(lookups: int = 1, embedding_dim: int = 128, bags: int = 1) -> tuple[int, int]:
    values = lookups * embedding_dim  # read each looked-up row once, write one row per bag: one add per value
    return FLOAT * (values + lookups + bags * embedding_dim + bags + 1), values


def _bag_backward(lookups: int = 1, embedding_dim: int = 128, bags: int = 1) -> tuple[int, int]:
    values = lookups * embedding_dim  # read d_out of the entry's bag, read-modify-write d_weight: scale and add
    return FLOAT * (3 * values + 2 * lookups + bags), 2 * values


def _per_sample_weights_backward(lookups: int = 1, embedding_dim: int = 128, bags: int = 1) -> tuple[int, int]:
    values = lookups * embedding_dim  # a dot product of d_out[bag] and the looked-up row per entry
    return FLOAT * (2 * values + 3 * lookups), 2 * values


def _renorm(rows: int = 1, embedding_dim: int = 128) -> tuple[int, int]:
    return FLOAT * (rows * embedding_dim + 2 * rows), 2 * rows * embedding_dim  # 2-norm: square and add


# Every kernel's napkin math, float32, from the header comments of metal_kernels/*.metal.
# Cells: (values read, written, FLOPs) per hidden unit; sequences: gate blocks, values written per unit
# and step, gate-math FLOPs per unit and step (on top of the 2 G H^2 FLOPs of h W_hh^T).
NAPKIN = {
    "lstm_cell": _cell_napkin(5, 7, 30),
    "lstm_cell_backward": _cell_napkin(8, 5, 25),  # d_h, d_c, activations (4), tanh_c, c_prev
    "gru_cell": _cell_napkin(7, 4, 20),
    "gru_cell_backward": _cell_napkin(8, 7, 20),
    "rnn_cell": _cell_napkin(1, 1, 1),
    "rnn_cell_backward": _cell_napkin(2, 1, 3),
    "lstm_sequence_simple": _sequence_napkin(4, 8, 30),
    "lstm_sequence": _sequence_napkin(4, 8, 30),
    "gru_sequence": _sequence_napkin(3, 8, 20),
    "embedding_gather": _gather,
    "embedding_backward": _scatter_add,
    "embedding_bag": _bag,
    "embedding_bag_backward": _bag_backward,
    "embedding_bag_per_sample_weights_backward": _per_sample_weights_backward,
    "embedding_renorm": _renorm,
}


def napkin(kernel: str, **sizes: int) -> Napkin:
    """Bytes and FLOPs of seqlib's Metal kernel ``kernel`` (a name of :data:`NAPKIN`) at the given sizes.

    Sizes by family: cells ``batch, hidden_size``; sequences ``steps, batch, hidden_size``; lookups and
    their gradients ``lookups, embedding_dim`` (bags also ``bags``); ``embedding_renorm`` ``rows,
    embedding_dim``.  float32 storage; the sequence kernels count W_hh as read from memory at every step
    (an upper bound on their traffic: it stays in cache when it fits).
    """
    if kernel not in NAPKIN:
        raise ValueError(f"napkin: kernel must be one of {sorted(NAPKIN)}, got {kernel!r}")
    bytes_moved, flops = NAPKIN[kernel](**sizes)
    return Napkin(kernel, bytes_moved, flops)


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


def lstm_cell_case(batch: int, hidden_size: int, backend: str | None = None) -> Case:
    backend = backend or _kernel_backend
    rng = np.random.default_rng(0)
    gates = mx.array(rng.standard_normal((batch, 4 * hidden_size)).astype(np.float32))
    c_prev = mx.array(rng.standard_normal((batch, hidden_size)).astype(np.float32))
    mx.eval(gates, c_prev)
    bytes_moved = FLOAT * batch * hidden_size * (5 + 7)  # read gates + c_prev, write h, c, tanh_c, activations
    return Case(
        name=f"LSTM gate math (one step), B={batch} H={hidden_size}",
        implementations={
            "ops path": _evaluated(lambda: pointwise.lstm_pointwise(gates, c_prev, compiled=True)),
            "metal": _on(backend, lambda: kernels.lstm_pointwise(gates, c_prev)),
        },
        bytes_moved=bytes_moved,
        flops=30 * batch * hidden_size,
        check=_max_error,
        tolerance=1e-5,
        notes=[f"napkin: {bytes_moved / 1e6:.2f} MB moved, ~30 FLOPs and 5 transcendentals per unit"],
        mlx_baseline="ops path",
    )


def lstm_layer_case(
    steps: int, batch: int, input_size: int, hidden_size: int, backend: str | None = None
) -> Case:
    backend = backend or _kernel_backend
    layer = seqlib.nn.LSTM(input_size, hidden_size)
    x = mx.random.normal((steps, batch, input_size), key=mx.random.key(0))
    x_gates = mx.addmm(layer.bias_ih_l0 + layer.bias_hh_l0, x.reshape(-1, input_size), layer.weight_ih_l0.T)
    h0 = mx.zeros((batch, hidden_size))
    mx.eval(layer.parameters(), x, x_gates)
    sizes = (batch,) * steps
    implementations = {
        "ops path": _on("ops", lambda: layer(x)[0]),
        "metal": _on(backend, lambda: layer(x)[0]),
    }
    if kernels.sequence_kernel_serves(batch, hidden_size):
        for label, version in (("metal v1 (simple)", "simple"), ("metal v2 (simd)", "simd")):
            implementations[label] = _on(
                backend,
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


def embedding_bag_case(
    num_embeddings: int, embedding_dim: int, bags: int, bag_size: int, backend: str | None = None
) -> Case:
    backend = backend or _kernel_backend
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
        implementations={"ops path": _on("ops", bag), "metal": _on(backend, bag)},
        bytes_moved=bytes_moved,
        check=_max_error,
        tolerance=1e-4,
        notes=[f"napkin: >= {bytes_moved / 1e6:.1f} MB moved (each looked-up row once), 1 FLOP per value"],
        mlx_baseline="ops path",
    )


def quick_cases(backend: str | None = None) -> list[Case]:
    """The ``--quick`` cases (small sizes: cheap through the emulation) on ``backend`` (None: the suite's)."""
    return [
        lstm_cell_case(2, 40, backend),
        lstm_layer_case(3, 2, 5, 40, backend),
        embedding_bag_case(50, 8, 4, 3, backend),
    ]


def max_errors(case: Case) -> dict[str, float]:
    """Each implementation's max error against the case's first one (its ops path), without timing anything."""
    names = list(case.implementations)
    reference = case.implementations[names[0]]()
    return {name: case.check(reference, case.implementations[name]()) for name in names[1:]}


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
        cases = quick_cases()
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
