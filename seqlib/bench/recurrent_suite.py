"""``python -m seqlib.bench recurrent``: LSTM and GRU layers against torch and ``mlx.nn``.

Four tables:

1. For each (T, B, D, H) of the recurrent issue and each of LSTM and GRU, two cases:
   the forward pass, and forward + backward (gradients of every weight and of the
   input, for the loss ``sum(output * w)``).
2. Scaling: microseconds per time step for T from 100 to 3,200, batch 1 and 32,
   D = H = 128, RNN/LSTM/GRU, forward and forward + backward: a cost linear in T
   keeps the per-step time flat.
3. Streaming: one step at batch 1 with a carried state, evaluated every step (a
   cell's call, a layer's ``step``), against torch single-threaded and on its default
   threads (seqlib's step shares large weights among threads); then an LSTMCell
   with 8-bit weights (``to_quantized``) against the float cell and torch's dynamically
   quantized int8 LSTMCell, at H = 128, 512 and 1,024 (float weights of 0.5, 8 and 32 MB:
   8 bits pay where the float step reads its weights from memory, not from cache).
4. Training a whole model: chapter 13's character model (Embedding(97, 32), a 2-layer
   LSTM, a Linear head, seqlib's cross-entropy, Adam; B = 64, L = 32), one training step,
   the MLX step compiled as MLX programs run it (``mx.compile`` with the model's and the
   optimizer's state) and eager, and compiled with ``mlx.nn.losses.cross_entropy`` in place of
   seqlib's, against the same model in torch from the same weights; then the step's parts
   against torch's (the embedding, LSTM layers, cross-entropy and Adam, which are seqlib's; the
   head, which is MLX's), to show which of them the whole step's ratio comes from.  Both sides
   run torch's Adam rule: ``seqlib.optim.Adam``, and torch's ``Adam(fused=True)``, its fastest
   on the CPU (the update alone at H = 512, 3.27M parameters, 2-core Zen 5: 1.8-2.3 ms against
   3.7-4.3 for its default).

Implementations:

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
from seqlib.bench.machine import measure_machine
from seqlib.interop import to_mlx

HAVE_TORCH = importlib.util.find_spec("torch") is not None
SHAPES = [(100, 32, 256, 512), (35, 20, 650, 650), (200, 64, 128, 128), (50, 1, 64, 256)]
QUICK_SHAPES = [(12, 4, 16, 32), (10, 1, 8, 16)]
GATE_BLOCKS = {"RNN": 1, "LSTM": 4, "GRU": 3}
# How cost grows with the sequence length: per-step time should stay flat from T=100 to T=3,200.  mlx.nn is
# timed up to SCALING_MLX_NN_STEPS only: its per-step cost grows with T (x3.9 from T=100 to 3,200, B=1,
# forward), and its forward + backward at B=32 took most of the harness's half hour on 2 cores.
SCALING_STEPS, QUICK_SCALING_STEPS, SCALING_MLX_NN_STEPS = (100, 400, 1600, 3200), (20, 80), 400
SCALING_BATCHES, SCALING_WIDTH = (1, 32), 128
# Streaming: one step at batch 1 with a carried state, evaluated every step, as a live stream runs.
STREAM_WIDTHS, QUICK_STREAM_WIDTHS, STREAM_STEPS = (128, 512), (16,), 50
# 8-bit weights pay where the float step is bound by reading its weights from memory.  An LSTMCell's float weights
# are 8 MB at H = 512, which a large L3 holds (the 2-core Zen 5: 32 MB, and there 8-bit / float was 0.58-0.65), and
# 32 MB at H = 1,024, which streams from memory on most machines (there 0.30-0.37).
QUANTIZED_WIDTHS, QUICK_QUANTIZED_WIDTHS, QUANTIZED_BITS, QUANTIZED_GROUP = (128, 512, 1024), (64,), 8, 64
# Training: chapter 13's character model at two widths.
TRAINING_WIDTHS, QUICK_TRAINING_WIDTHS = (128, 512), (16,)
CHAR_VOCAB, CHAR_EMBEDDING, CHAR_BATCH, CHAR_WINDOW, CHAR_LAYERS = 97, 32, 64, 32, 2


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

    def forward_backward():  # the loss evaluated too, as torch computes it: MLX evaluates only what is asked for
        value, (parameter_grads, input_grad) = mx.value_and_grad(loss, argnums=(0, 1))(
            layer.trainable_parameters(), x_batch_first)  # fmt: skip
        mx.eval(value, parameter_grads, input_grad)
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


def recurrent_case(kind: str, shape: tuple[int, int, int, int], backward: bool, with_mlx_nn: bool = True) -> Case:
    """One layer's forward (or forward + backward) as seqlib, mlx.nn (unless ``with_mlx_nn`` is False), torch run it."""
    steps, batch, input_size, hidden_size = shape
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((batch, steps, input_size)).astype(np.float32)  # batch-first, as mlx.nn
    weights_np = rng.uniform(-1, 1, (batch, steps, hidden_size)).astype(np.float32)
    ours = getattr(seqlib.nn, kind)(input_size, hidden_size, batch_first=True)
    theirs_mlx = to_mlx(ours)
    x, weights = mx.array(x_np), mx.array(weights_np)
    mx.eval(ours.parameters(), theirs_mlx.parameters(), x, weights)
    implementations = {"seqlib": _mlx_implementations(ours, x, weights, backward)}
    if with_mlx_nn:
        implementations["mlx.nn"] = _mlx_implementations(theirs_mlx, x, weights, backward)
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
    machine = measure_machine()
    print(machine.describe())
    rows = run_cases(cases, repeats=2 if quick else repeats, warmup=1, machine=machine)
    _print_summary(rows)
    print_peak_memory(shapes)
    print_scaling(QUICK_SCALING_STEPS if quick else SCALING_STEPS, repeats=2 if quick else max(3, repeats // 2))
    print_streaming(QUICK_STREAM_WIDTHS if quick else STREAM_WIDTHS, repeats=2 if quick else repeats, machine=machine)
    print_quantized_streaming(QUICK_QUANTIZED_WIDTHS if quick else QUANTIZED_WIDTHS, repeats=2 if quick else repeats,
                              machine=machine)  # fmt: skip
    print_training_steps(QUICK_TRAINING_WIDTHS if quick else TRAINING_WIDTHS, repeats=2 if quick else 3 * repeats,
                         machine=machine)  # fmt: skip


# ----------------------------------------------------------------- memory of a training step


def _training_step_peak(layer, x, weights, is_seqlib: bool) -> tuple[int, int]:
    """(peak bytes, resident bytes before) of one value_and_grad + SGD step of ``layer`` on the CPU."""
    import mlx.optimizers

    def loss(model, x):
        out = model(x)
        return ((out[0] if is_seqlib or isinstance(out, tuple) else out) * weights).sum()

    step = mlx.nn.value_and_grad(layer, loss)
    optimizer = mlx.optimizers.SGD(learning_rate=0.01)
    for measured in (False, True):  # the first step is a warm-up
        if measured:
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
        _, grads = step(layer, x)
        optimizer.update(layer, grads)
        mx.eval(layer.parameters())
    return mx.get_peak_memory(), before


def print_peak_memory(shapes=SHAPES) -> None:
    """Peak MLX memory of one training step (forward, backward, SGD update) next to the parameter bytes."""
    from mlx.utils import tree_flatten

    print("\npeak memory of one training step (forward, backward, SGD), MB: peak, and peak above what was resident")
    for kind in ("LSTM", "GRU"):
        for steps, batch, input_size, hidden_size in shapes:
            rng = np.random.default_rng(0)
            x = mx.array(rng.standard_normal((batch, steps, input_size)).astype(np.float32))
            weights = mx.array(rng.uniform(-1, 1, (batch, steps, hidden_size)).astype(np.float32))
            ours = getattr(seqlib.nn, kind)(input_size, hidden_size, batch_first=True)
            theirs = to_mlx(ours)
            parameter_bytes = sum(v.nbytes for _, v in tree_flatten(ours.parameters()))
            activation_bytes = steps * batch * hidden_size * 4
            line = f"  {kind} T={steps} B={batch} D={input_size} H={hidden_size}: "
            line += f"parameters {parameter_bytes / 1e6:6.2f}, one layer output {activation_bytes / 1e6:6.2f}"
            for name, layer, is_seqlib in (("seqlib", ours, True), ("mlx.nn", theirs, False)):
                peak, before = _training_step_peak(layer, x, weights, is_seqlib)
                line += f" | {name} {peak / 1e6:7.1f} ({(peak - before) / 1e6:6.1f} above)"
            print(line)


# ----------------------------------------------------------------- scaling with the sequence length


def print_scaling(steps_list=SCALING_STEPS, batches=SCALING_BATCHES, repeats: int = 3) -> list[dict]:
    """Time every kind, direction and batch at each T; print microseconds per step and how they grow."""
    print(f"\nscaling with T: microseconds per time step (D = H = {SCALING_WIDTH}; median of {repeats})")
    print("  growth = per-step time at the longest T / at the shortest; flat cost in T gives about 1")
    print(f"  mlx.nn only up to T={SCALING_MLX_NN_STEPS} (its cost per step grows with T; '-' where not timed)")
    all_rows = []
    for kind in ("LSTM", "GRU", "RNN"):
        for backward in (False, True):
            for batch in batches:
                shapes = [(steps, batch, SCALING_WIDTH, SCALING_WIDTH) for steps in steps_list]
                cases = [recurrent_case(kind, shape, backward, with_mlx_nn=shape[0] <= SCALING_MLX_NN_STEPS)
                         for shape in shapes]  # fmt: skip
                rows = run_cases(cases, repeats=repeats, warmup=1, show=False)
                all_rows += rows
                _print_scaling_rows(kind, backward, batch, steps_list, rows)
    return all_rows


def _print_scaling_rows(kind: str, backward: bool, batch: int, steps_list, rows: list[dict]) -> None:
    what = "fwd+bwd" if backward else "forward"
    per_step = {}  # implementation -> {T: us per step}, for the T it was timed at
    for row, steps in zip(rows, _steps_of_rows(rows, steps_list), strict=True):
        per_step.setdefault(row["implementation"], {})[steps] = 1e3 * row["median_ms"] / steps

    def cells(values: dict, digits: int) -> str:  # one column per T, '-' where not timed
        return "".join(f"{values[t]:>10.{digits}f}" if t in values else f"{'-':>10}" for t in steps_list)

    print(f"\n  {kind} {what}, B={batch}    " + "".join(f"{'T=' + str(t):>10}" for t in steps_list) + "    growth")
    for name, times in per_step.items():
        timed = [t for t in steps_list if t in times]
        span = "" if len(timed) == len(steps_list) else f" (T={timed[0]}-{timed[-1]})"
        print(f"    {name:<22}{cells(times, 1)}    x{times[timed[-1]] / times[timed[0]]:.2f}{span}")
    ours = per_step["seqlib"]
    for name in ("mlx.nn", "torch", "torch (1 thread)"):
        if name in per_step:
            print(f"    {'seqlib / ' + name:<22}" + cells({t: ours[t] / v for t, v in per_step[name].items()}, 2))


def _steps_of_rows(rows: list[dict], steps_list) -> list[int]:
    """The T of each row: run_cases' rows come case by case, in steps_list's order."""
    cases = list(dict.fromkeys(row["case"] for row in rows))
    return [steps_list[cases.index(row["case"])] for row in rows]


# ----------------------------------------------------------------- streaming, one step at a time


def _stream_inputs(input_size: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((STREAM_STEPS, 1, input_size)).astype(np.float32)


def _plain_mlx_cell_step(kind: str, cell):
    """The same step in plain MLX ops, no seqlib in between: the "mlx ops" baseline."""
    w_ih, w_hh = cell.weight_ih.T, cell.weight_hh.T
    b_ih, b_hh = cell.bias_ih, cell.bias_hh
    if kind == "LSTMCell":
        bias = b_ih + b_hh

        def step(x, state):
            i, f, g, o = mx.split(x @ w_ih + state[0] @ w_hh + bias, 4, axis=-1)
            c = mx.sigmoid(f) * state[1] + mx.sigmoid(i) * mx.tanh(g)
            return mx.sigmoid(o) * mx.tanh(c), c

        return step

    def step(x, h):
        input_r, input_z, input_n = mx.split(x @ w_ih + b_ih, 3, axis=-1)
        hidden_r, hidden_z, hidden_n = mx.split(h @ w_hh + b_hh, 3, axis=-1)
        r, z = mx.sigmoid(input_r + hidden_r), mx.sigmoid(input_z + hidden_z)
        n = mx.tanh(input_n + r * hidden_n)
        return (1 - z) * n + z * h

    return step


def _streamed(step, xs, state):
    """Run ``state = step(x_t, state)`` over xs, evaluating every step; the last h as NumPy."""
    for x in xs:
        state = step(x, state)
        mx.eval(state)
    return np.array(state[0] if isinstance(state, tuple) else state)


def _torch_streamed(step, xs, state, threads: int | None = 1):
    """torch's stream, on one thread (the steadier reference at batch 1) or on ``threads`` (None: its default)."""
    import torch

    with _torch_threads(threads), torch.no_grad():
        for x in xs:
            state = step(x, state)
    return (state[0] if isinstance(state, tuple) else state).numpy()


def streaming_case(kind: str, hidden_size: int) -> Case:
    """``kind``: "LSTMCell"/"GRUCell" (a cell's call) or "LSTM"/"GRU" (a one-layer layer's ``step``)."""
    is_cell = kind.endswith("Cell")
    cell_kind = kind if is_cell else kind + "Cell"
    xs_np = _stream_inputs(hidden_size)
    xs = [mx.array(x) for x in xs_np]
    mx.eval(xs)
    zeros = mx.zeros((1, hidden_size))
    if is_cell:
        ours = getattr(seqlib.nn, kind)(hidden_size, hidden_size)
        initial = (zeros, zeros) if kind == "LSTMCell" else zeros
        implementations = {"seqlib": lambda: _streamed(ours, xs, initial)}
        implementations["mlx ops"] = lambda: _streamed(_plain_mlx_cell_step(kind, ours), xs, initial)
    else:
        ours = getattr(seqlib.nn, kind)(hidden_size, hidden_size)
        initial = (zeros[None], zeros[None]) if kind == "LSTM" else zeros[None]
        implementations = {"seqlib": lambda: _streamed(lambda x, s: ours.step(x, s)[1], xs, initial)}
        theirs_mlx = to_mlx(ours)  # mlx.nn's layer on a sequence of one step, with its state
        if kind == "LSTM":
            def mlx_nn_step(x, state):
                hidden, cell = theirs_mlx(x[:, None], state[0], state[1])
                return hidden[:, 0], cell[:, 0]
            implementations["mlx.nn"] = lambda: _streamed(mlx_nn_step, xs, (zeros, zeros))
        else:
            implementations["mlx.nn"] = lambda: _streamed(lambda x, h: theirs_mlx(x[:, None], h)[:, 0], xs, zeros)
    mx.eval(ours.parameters())
    if HAVE_TORCH:
        import torch

        theirs = getattr(torch.nn, cell_kind)(hidden_size, hidden_size)
        state_dict = ours.torch_state_dict()
        theirs.load_state_dict({name.replace("_l0", ""): torch.from_numpy(np.array(value))
                                for name, value in state_dict.items()})  # fmt: skip
        xs_torch = [torch.from_numpy(x) for x in xs_np]
        zeros_torch = torch.zeros(1, hidden_size)
        torch_initial = (zeros_torch, zeros_torch) if cell_kind == "LSTMCell" else zeros_torch
        implementations["torch (1 thread)"] = lambda: _torch_streamed(lambda x, s: theirs(x, s), xs_torch,
                                                                      torch_initial)  # fmt: skip
        # on its default threads too: seqlib's step shares large weights among threads (see seqlib.native)
        implementations["torch"] = lambda: _torch_streamed(lambda x, s: theirs(x, s), xs_torch, torch_initial, None)
    gates = GATE_BLOCKS[cell_kind[:-4]] * hidden_size
    flops = 2 * STREAM_STEPS * gates * 2 * hidden_size
    what = "cell call" if is_cell else "layer.step"
    return Case(
        name=f"streaming {kind} ({what}), H={hidden_size}, batch 1, {STREAM_STEPS} steps",
        implementations=implementations,
        bytes_moved=4 * STREAM_STEPS * gates * 2 * hidden_size,  # W_ih and W_hh read every step
        flops=flops,
        check=lambda a, b: _relative_error(a, b),
        tolerance=1e-4,
        mlx_baseline="mlx ops" if is_cell else "mlx.nn",
    )


def print_streaming(widths=STREAM_WIDTHS, repeats: int = 7, machine=None) -> list[dict]:
    """Time one streamed step per kind and width; print microseconds per step and ratios to torch (and, given
    ``machine``, seqlib's time over the step's limit: its weights' bytes over the bandwidth, or its FLOPs over
    the matmul rate; weights that stay in cache can beat the first)."""
    print("\nstreaming: microseconds per step at batch 1, state carried, evaluated every step")
    rows = []
    for hidden_size in widths:
        for kind in ("LSTMCell", "GRUCell", "LSTM", "GRU"):
            case_rows = run_cases([streaming_case(kind, hidden_size)], repeats=repeats, warmup=1, show=False,
                                  machine=machine)
            rows += case_rows
            print(_streaming_line(f"  {case_rows[0]['case']:<62}", case_rows,
                                  [("seqlib/torch 1-thread", "seqlib", "torch (1 thread)"),
                                   ("seqlib/torch", "seqlib", "torch")]))  # fmt: skip
    return rows


def _streaming_line(label: str, case_rows: list[dict], ratios: list[tuple[str, str, str]]) -> str:
    """One line of a streaming table: each implementation's microseconds per step, each ratio ``(text,
    numerator, denominator)`` whose two implementations were timed, and the first's time over its limit."""
    times = {row["implementation"]: 1e3 * row["median_ms"] / STREAM_STEPS for row in case_rows}
    line = label + "".join(f"  {name} {time:7.1f}" for name, time in times.items())
    line += "".join(f"   {text} x{times[a] / times[b]:.2f}" for text, a, b in ratios if a in times and b in times)
    if case_rows[0]["vs_limit"] is not None:
        line += f"   x{case_rows[0]['vs_limit']:.1f} limit"
    return line


def _torch_int8_cell(cell_state_dict, hidden_size: int):
    """torch's dynamically quantized int8 LSTMCell (``quantize_dynamic``, fbgemm) from the float weights."""
    import warnings

    import torch

    holder = torch.nn.Module()
    holder.cell = torch.nn.LSTMCell(hidden_size, hidden_size)
    holder.cell.load_state_dict(cell_state_dict)
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice (it moves to torchao)
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(holder, {torch.nn.LSTMCell}, dtype=torch.qint8).cell


def quantized_streaming_case(hidden_size: int) -> Case:
    """One streamed LSTMCell step at batch 1 with 8-bit weights (seqlib's ``to_quantized``: the step reads the
    packed integers) against the float cell, and torch's float and dynamically quantized int8 cells."""
    xs_np = _stream_inputs(hidden_size)
    xs = [mx.array(x) for x in xs_np]
    cell = seqlib.nn.LSTMCell(hidden_size, hidden_size)
    quantized = cell.to_quantized(group_size=QUANTIZED_GROUP, bits=QUANTIZED_BITS)
    zeros = mx.zeros((1, hidden_size))
    mx.eval(xs, cell.parameters(), quantized.parameters())
    implementations = {f"seqlib {QUANTIZED_BITS}-bit": lambda: _streamed(quantized, xs, (zeros, zeros)),
                       "seqlib float": lambda: _streamed(cell, xs, (zeros, zeros))}  # fmt: skip
    if HAVE_TORCH:
        import torch

        state_dict = {name: torch.from_numpy(np.array(value)) for name, value in cell.torch_state_dict().items()}
        theirs = torch.nn.LSTMCell(hidden_size, hidden_size)
        theirs.load_state_dict(state_dict)
        int8 = _torch_int8_cell(state_dict, hidden_size)
        xs_torch = [torch.from_numpy(x) for x in xs_np]
        initial = (torch.zeros(1, hidden_size), torch.zeros(1, hidden_size))
        implementations["torch int8 (1 thread)"] = lambda: _torch_streamed(int8, xs_torch, initial)
        implementations["torch (1 thread)"] = lambda: _torch_streamed(theirs, xs_torch, initial)
    gates = 4 * hidden_size
    weight_bytes = 2 * gates * hidden_size * (QUANTIZED_BITS / 8 + 8 / QUANTIZED_GROUP)  # values, scales, biases
    return Case(
        name=f"streaming LSTMCell, {QUANTIZED_BITS}-bit weights, H={hidden_size}, batch 1, {STREAM_STEPS} steps",
        implementations=implementations,
        bytes_moved=STREAM_STEPS * weight_bytes,
        flops=2 * STREAM_STEPS * gates * 2 * hidden_size,
        check=lambda a, b: _relative_error(a, b),
        tolerance=0.05,  # the float cells and torch's int8 one differ from the 8-bit weights by their quantization
        mlx_baseline="seqlib float",
    )


def print_quantized_streaming(widths=QUANTIZED_WIDTHS, repeats: int = 7, machine=None) -> list[dict]:
    """Time the 8-bit streamed step per width; print microseconds per step and its ratio to the float step, with
    the float weights' size (the float step is bound by reading them once they outgrow the last-level cache)."""
    print(f"\nstreaming with {QUANTIZED_BITS}-bit weights: microseconds per step at batch 1 (LSTMCell; MB: the float "
          f"weights a step reads)")
    rows = []
    for hidden_size in widths:
        case_rows = run_cases([quantized_streaming_case(hidden_size)], repeats=repeats, warmup=1, show=False,
                              machine=machine)  # fmt: skip
        rows += case_rows
        ours = f"seqlib {QUANTIZED_BITS}-bit"
        ratios = [(f"{QUANTIZED_BITS}-bit / float", ours, "seqlib float"),
                  ("/ torch int8", ours, "torch int8 (1 thread)")]
        float_mb = 4 * 4 * hidden_size * 2 * hidden_size / 2**20  # W_ih and W_hh, (4H, H) each
        print(_streaming_line(f"  H={hidden_size:<5}{float_mb:5.1f} MB", case_rows, ratios))
    return rows


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
        limit = next(row["vs_limit"] for row in rows if row["case"] == case and row["implementation"] == "seqlib")
        if limit is not None:
            line += f"   x{limit:.2f} limit"
        print(line)


# ----------------------------------------------------------------- training a whole model


class _CharModel(mlx.nn.Module):
    """Chapter 13's character model: Embedding, a stacked LSTM, a Linear head; (B, L) ids -> (B, L, V) logits."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.embedding = seqlib.nn.Embedding(CHAR_VOCAB, CHAR_EMBEDDING)
        self.recurrent = seqlib.nn.LSTM(CHAR_EMBEDDING, hidden_size, num_layers=CHAR_LAYERS, batch_first=True)
        self.head = mlx.nn.Linear(hidden_size, CHAR_VOCAB)

    def __call__(self, ids):
        output, _ = self.recurrent(self.embedding(ids))
        return self.head(output)


# The losses a step can take.  "cross-entropy" is the model's (seqlib.functional.cross_entropy); "MLX's
# cross-entropy" is mlx.nn.losses.cross_entropy, the same loss, which on x86 CPUs computes exp one element at a
# time; the other two are linear in the logits or in the LSTM's output (fixed weights, _linear_loss_weights), so
# that a step with one of them, timed as the whole step is, tells by difference what the cross-entropy and the
# head cost inside the step (training_parts_case).
CHAR_LOSSES = ("cross-entropy", "MLX's cross-entropy", "linear in the logits", "linear in the LSTM output")
MLX_CROSS_ENTROPY = CHAR_LOSSES[1]
MLX_LOSS_STEP = "seqlib (mlx.nn loss)"  # the compiled step with MLX's cross-entropy, as run_cases names it


def _linear_loss_weights(hidden_size: int) -> dict[str, np.ndarray]:
    """Fixed (B, L, V) and (B, L, H) weights of the two linear losses."""
    rng = np.random.default_rng(1)
    return {"linear in the logits": rng.uniform(-1, 1, (CHAR_BATCH, CHAR_WINDOW, CHAR_VOCAB)).astype(np.float32),
            "linear in the LSTM output": rng.uniform(-1, 1, (CHAR_BATCH, CHAR_WINDOW, hidden_size)).astype(np.float32)}


def _char_loss_function(loss: str, hidden_size: int):
    """MLX's loss(model, ids, targets) of the named kind (CHAR_LOSSES)."""
    if loss not in CHAR_LOSSES:
        raise ValueError(f"loss: expected one of {CHAR_LOSSES}, got {loss!r}")
    if loss == "cross-entropy":
        return lambda model, ids, targets: seqlib.functional.cross_entropy(
            model(ids).reshape(-1, CHAR_VOCAB), targets.reshape(-1))  # fmt: skip
    if loss == MLX_CROSS_ENTROPY:
        return lambda model, ids, targets: mlx.nn.losses.cross_entropy(model(ids), targets, reduction="mean")
    weights = mx.array(_linear_loss_weights(hidden_size)[loss])
    if loss == "linear in the logits":
        return lambda model, ids, targets: (model(ids) * weights).sum()
    return lambda model, ids, targets: (model.recurrent(model.embedding(ids))[0] * weights).sum()


def _mlx_training_step(hidden_size: int, compiled: bool, loss: str = "cross-entropy", update: bool = True):
    """A fresh model (seed 0), seqlib's Adam, and a function running one training step on (ids, targets): the
    loss.  loss: one of CHAR_LOSSES; update: False leaves out the optimizer's update (the gradients are still
    evaluated)."""
    mx.random.seed(0)
    model = _CharModel(hidden_size)
    optimizer = seqlib.optim.Adam(learning_rate=1e-3)
    mx.eval(model.parameters())
    state = [model.state, optimizer.state]
    loss_and_grad = mlx.nn.value_and_grad(model, _char_loss_function(loss, hidden_size))

    def step(ids, targets):
        value, grads = loss_and_grad(model, ids, targets)
        if not update:
            return value, grads
        optimizer.update(model, grads)
        return value

    if compiled:  # MLX's pattern for a training step: the model's and the optimizer's state as implicit inputs
        step = mx.compile(step, inputs=state, outputs=state)

    def run(ids, targets):
        outputs = step(ids, targets)
        mx.eval(state, outputs)
        return (outputs if update else outputs[0]).item()

    return model, run


def _torch_char_model(model: _CharModel):
    """torch's Embedding, LSTM and Linear with ``model``'s weights."""
    import torch

    embedding = torch.nn.Embedding(CHAR_VOCAB, CHAR_EMBEDDING)
    recurrent = torch.nn.LSTM(CHAR_EMBEDDING, model.head.weight.shape[1], num_layers=CHAR_LAYERS, batch_first=True)
    head = torch.nn.Linear(model.head.weight.shape[1], CHAR_VOCAB)
    with torch.no_grad():
        embedding.weight.copy_(torch.from_numpy(np.array(model.embedding.weight)))
        recurrent.load_state_dict({name: torch.from_numpy(np.array(value))
                                   for name, value in model.recurrent.torch_state_dict().items()})  # fmt: skip
        head.weight.copy_(torch.from_numpy(np.array(model.head.weight)))
        head.bias.copy_(torch.from_numpy(np.array(model.head.bias)))
    return embedding, recurrent, head


def _torch_training_step(model: _CharModel, loss: str = "cross-entropy", update: bool = True):
    """The same model in torch, from ``model``'s weights, with its fused Adam: a function running one step (the
    loss); loss and update as _mlx_training_step's."""
    import torch

    embedding, recurrent, head = _torch_char_model(model)
    parameters = [*embedding.parameters(), *recurrent.parameters(), *head.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=1e-3, fused=True)
    if loss not in ("cross-entropy", MLX_CROSS_ENTROPY):
        weights = torch.from_numpy(_linear_loss_weights(model.head.weight.shape[1])[loss])

    def loss_of(ids, targets):
        output = recurrent(embedding(ids))[0]
        if loss == "linear in the LSTM output":
            return (output * weights).sum()
        if loss == "linear in the logits":
            return (head(output) * weights).sum()
        return torch.nn.functional.cross_entropy(head(output).reshape(-1, CHAR_VOCAB), targets.reshape(-1))

    def run(ids, targets):
        optimizer.zero_grad()
        value = loss_of(ids, targets)
        value.backward()
        if update:
            optimizer.step()
        return value.item()

    return run


def _char_batch() -> tuple[np.ndarray, np.ndarray]:
    """The benchmark's (B, L) input ids and targets."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CHAR_VOCAB, (CHAR_BATCH, CHAR_WINDOW)).astype(np.int32)
    return ids, rng.integers(0, CHAR_VOCAB, (CHAR_BATCH, CHAR_WINDOW)).astype(np.int32)


def _training_implementations(hidden_size: int, loss: str, update: bool, eager: bool, mlx_loss: bool = False) -> dict:
    """seqlib's step compiled (and eager, where asked; and compiled with MLX's cross-entropy in place of
    ``loss``, where asked: MLX_LOSS_STEP) and torch's, from the same weights, as run_cases takes them."""
    ids_np, targets_np = _char_batch()
    ids, targets = mx.array(ids_np), mx.array(targets_np)
    model, compiled = _mlx_training_step(hidden_size, compiled=True, loss=loss, update=update)
    implementations = {"seqlib (compiled)": lambda: compiled(ids, targets)}
    if eager:
        eager_step = _mlx_training_step(hidden_size, compiled=False, loss=loss, update=update)[1]
        implementations["seqlib (eager)"] = lambda: eager_step(ids, targets)
    if mlx_loss:
        mlx_loss_step = _mlx_training_step(hidden_size, compiled=True, loss=MLX_CROSS_ENTROPY, update=update)[1]
        implementations[MLX_LOSS_STEP] = lambda: mlx_loss_step(ids, targets)
    if HAVE_TORCH:
        import torch

        ids_t, targets_t = torch.from_numpy(ids_np.astype(np.int64)), torch.from_numpy(targets_np.astype(np.int64))
        theirs = _torch_training_step(model, loss=loss, update=update)
        implementations["torch"] = lambda: theirs(ids_t, targets_t)
    return implementations


def _relative_loss_error(a: float, b: float) -> float:  # the first steps' losses, from the same weights
    return abs(a - b) / max(abs(a), 1e-30)


def training_step_case(hidden_size: int) -> Case:
    """One training step of the character model: seqlib compiled and eager, torch; the first steps' losses agree."""
    # FLOPs of the matmuls: each LSTM layer 2 B L 4H (D + H), the head 2 B L H V; backward twice the forward
    tokens, gates = CHAR_BATCH * CHAR_WINDOW, 4 * hidden_size
    forward = 2 * tokens * gates * (CHAR_EMBEDDING + hidden_size) + 2 * tokens * gates * 2 * hidden_size * (
        CHAR_LAYERS - 1) + 2 * tokens * hidden_size * CHAR_VOCAB  # fmt: skip
    return Case(
        name=f"training step, character model H={hidden_size} (2-layer LSTM, B={CHAR_BATCH}, L={CHAR_WINDOW}, Adam)",
        implementations=_training_implementations(hidden_size, "cross-entropy", update=True, eager=True,
                                                  mlx_loss=True),
        flops=3 * forward,
        check=_relative_loss_error,
        tolerance=1e-4,
        notes=[f"napkin: {3 * forward / 1e9:.2f} GFLOP of matmuls per step"],
        mlx_baseline="seqlib (eager)",
    )


# The step with parts left out, timed as the whole step is and interleaved with it (one case, so that every
# variant sees the same state of the machine): the differences between consecutive variants are what each
# part costs inside the step.  (Each part timed on its own, after an idle wait, gave the LSTM layers 21-25 ms at
# H = 128 against 15-16 in the step, 2-core Sapphire Rapids: a part called alone pays waking threads and
# refilling caches that a step's later parts find ready.)
TRAINING_VARIANTS = (("whole step", "cross-entropy", True),
                     ("cross-entropy replaced by a loss linear in the logits", "linear in the logits", True),
                     ("no head: a loss linear in the LSTM output", "linear in the LSTM output", True),
                     ("no head and no Adam update", "linear in the LSTM output", False))  # fmt: skip
TRAINING_PARTS = ("cross-entropy forward+backward (seqlib)", "head (Linear) forward+backward (MLX)",
                  "Adam update (seqlib)", "embedding + LSTM layers forward+backward (seqlib)")  # fmt: skip


def training_parts_case(hidden_size: int) -> Case:
    """Every variant of TRAINING_VARIANTS, seqlib compiled and torch, as one case (implementations named
    "<library>: <variant>"); unchecked here: check_training_variants compares their losses."""
    implementations = {}
    for name, loss, update in TRAINING_VARIANTS:
        for library, run in _training_implementations(hidden_size, loss, update, eager=False).items():
            implementations[f"{library}: {name}"] = run
    return Case(name=f"training step variants, H={hidden_size}", implementations=implementations)


def check_training_variants(case: Case, tolerance: float = 1e-3) -> None:
    """Each variant's first loss, seqlib's against torch's (the same weights): raise where they disagree.
    1e-3: a loss linear in the output adds terms of both signs, so float32 sums in another order can differ
    by more than 1e-4 of such a total (2e-5 at H = 128 on a 2-core Sapphire Rapids)."""
    runs = {name: run() for name, run in case.implementations.items()}
    for name, _, _ in TRAINING_VARIANTS:
        if f"torch: {name}" in runs:
            error = _relative_loss_error(runs[f"seqlib (compiled): {name}"], runs[f"torch: {name}"])
            if error > tolerance:
                raise AssertionError(f"{case.name}, {name}: torch disagrees with seqlib (relative error {error:.2e})")


def _training_parts(medians: dict[str, float], library: str) -> dict[str, float]:
    """TRAINING_PARTS' times for one library from the variants' medians (as run_cases names them): each part but
    the last is the difference of two consecutive variants, the last the last variant's own time."""
    times = [medians[f"{library}: {name}"] for name, _, _ in TRAINING_VARIANTS]
    parts = {name: times[i] - times[i + 1] for i, name in enumerate(TRAINING_PARTS[:-1])}
    parts[TRAINING_PARTS[-1]] = times[-1]
    return parts


def print_training_steps(widths=TRAINING_WIDTHS, repeats: int = 21, machine=None) -> list[dict]:
    """Time one training step per width (the first call of each compiles or warms it; every implementation's
    first step is checked against the first's loss); print the table and the ratios to torch."""
    print("\ntraining a whole model: one step of chapter 13's character model, interleaved with torch")
    rows = []
    for hidden_size in widths:
        case_rows = run_cases([training_step_case(hidden_size)], repeats=repeats, warmup=2, machine=machine)
        rows += case_rows
        times = {row["implementation"]: row["median_ms"] for row in case_rows}
        if "torch" in times:
            with_mlx_loss = times[MLX_LOSS_STEP]
            print(f"  H={hidden_size}: seqlib compiled / torch x{times['seqlib (compiled)'] / times['torch']:.2f}, "
                  f"eager / torch x{times['seqlib (eager)'] / times['torch']:.2f}, compiled with MLX's "
                  f"cross-entropy / torch x{with_mlx_loss / times['torch']:.2f}")  # fmt: skip
        variants = training_parts_case(hidden_size)
        check_training_variants(variants)
        part_rows = run_cases([variants], repeats=repeats, warmup=2, show=False)
        medians = {row["implementation"]: row["median_ms"] for row in part_rows}
        libraries = [library for library in ("seqlib (compiled)", "torch") if f"{library}: whole step" in medians]
        parts = {library: _training_parts(medians, library) for library in libraries}
        print(f"  H={hidden_size}, the step's parts, ms ({' / '.join(libraries)}): differences of the step with parts "
              "left out, interleaved with it")  # fmt: skip
        for name in TRAINING_PARTS:
            print(f"    {name:<52} " + " / ".join(f"{parts[library][name]:8.2f}" for library in libraries))
        rows += part_rows
    return rows
