"""A/B timing of seqlib's C++ CPU primitives: this checkout's build against a variant of its sources.

    .venv/bin/python tools/ab_native.py build VARIANT_DIR variant.so      (about 30 s on 2 cores)
    .venv/bin/python tools/ab_native.py loop variant.so [--base base.so]
    .venv/bin/python tools/ab_native.py layer variant.so [--base base.so] [--kind GRU]
    .venv/bin/python tools/ab_native.py stream variant.so [--base base.so]

``build`` compiles the .cpp/.h files of VARIANT_DIR (a copy of seqlib/native/ with a change in it) with
seqlib's own compile command, as a module of another name (``_seqlib_cpu_b``), so that both builds load
into one process.  The other commands time the base (this checkout's seqlib.native, or ``--base``, another
variant) and the variant interleaved in that process, each call after ``seqlib.bench.settle``, and print
medians and the variant's ratio:

- ``loop``: the LSTM forward loop alone (``lstm_sequence`` on evaluated x_gates) at three shapes;
- ``layer``: a layer's forward and forward+backward (the parameters' gradients and x's, as the recurrent
  suite takes them), seqlib.nn.LSTM or GRU, at the issue's shapes;
- ``stream``: an LSTMCell streamed at batch 1 for 50 steps, H = 128 and 512.

Ratios of a few percent need repeats and a quiet machine: run each comparison twice.  An A/A run (the
variant built from unchanged sources) gave 0.94-1.03 on a 2-core virtual machine: there, differences under
about 5% are noise.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANT_MODULE = "_seqlib_cpu_b"


def build(source_dir: Path, output: Path) -> None:
    import mlx.core as mx

    from seqlib import _build

    folder = Path(tempfile.mkdtemp())
    for path in source_dir.iterdir():
        if path.suffix in (".cpp", ".h"):
            shutil.copy(path, folder / path.name)
    module = folder / "module.cpp"
    module.write_text(module.read_text().replace("NB_MODULE(_seqlib_cpu,", f"NB_MODULE({VARIANT_MODULE},"))
    _build.NATIVE_SOURCES = tuple(folder / path.name for path in _build.NATIVE_SOURCES)
    _build.NATIVE_HEADER = folder / _build.NATIVE_HEADER.name
    subprocess.run(_build.native_command(Path(mx.__file__).parent, output.resolve()), check=True)
    print(f"built {output}")


def load(path: str):
    """The variant module built at ``path``.  The BLAS shim is loaded first, as seqlib.native loads it before its
    own build: a variant loaded without it would bind ``cblas_sgemm`` to MLX's reference BLAS (through libmlx.so),
    and its per-step products (the Elman RNN's) would run several times slower than the base's."""
    from seqlib import _blas

    _blas.load_shim()
    loader = importlib.machinery.ExtensionFileLoader(VARIANT_MODULE, path)
    spec = importlib.util.spec_from_file_location(VARIANT_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def use(module) -> None:
    """Make seqlib's layers run ``module``'s primitives (seqlib.native decides once, then keeps its choice)."""
    from seqlib import native

    native.extension()
    native._state.update(module=module, loaded=module)


def compare(name: str, calls: dict, repeats: int = 15) -> None:
    """Time each of ``calls`` (label: (module, function)) interleaved, alternating the order, after settle."""
    from seqlib.bench import settle

    samples = {label: [] for label in calls}
    for module, function in calls.values():
        use(module)
        function()
    labels = list(calls)
    for repeat in range(repeats):
        for label in labels if repeat % 2 == 0 else labels[::-1]:
            module, function = calls[label]
            use(module)
            settle()
            start = time.perf_counter()
            function()
            samples[label].append(time.perf_counter() - start)
    base, variant = (statistics.median(samples[label]) * 1e3 for label in labels)
    print(f"{name}: base {base:.2f} ms, variant {variant:.2f} ms, variant / base {variant / base:.3f}", flush=True)


def loop_cases(base, variant) -> None:
    import mlx.core as mx

    for steps, batch, hidden in ((100, 32, 512), (35, 20, 650), (200, 64, 128)):
        x_gates = mx.random.normal((steps * batch, 4 * hidden))
        w_hh = mx.random.normal((4 * hidden, hidden)) * hidden**-0.5
        h0 = mx.zeros((batch, hidden))
        mx.eval(x_gates, w_hh, h0)

        def run(module, x_gates=x_gates, w_hh=w_hh, h0=h0, batch=batch, steps=steps):
            return lambda: mx.eval(module.lstm_sequence(x_gates, w_hh, h0, h0, [batch] * steps, False, False)[0])

        compare(f"LSTM loop (T, B, H) = {(steps, batch, hidden)}", {"base": (base, run(base)),
                                                                     "variant": (variant, run(variant))})  # fmt: skip


def layer_cases(base, variant, kind: str) -> None:
    import mlx.core as mx

    import seqlib.nn

    for steps, batch, input_size, hidden in ((100, 32, 256, 512), (35, 20, 650, 650), (200, 64, 128, 128)):
        layer = getattr(seqlib.nn, kind)(input_size, hidden)
        x = mx.random.normal((steps, batch, input_size))
        mx.eval(layer.parameters(), x)

        def loss(parameters, x, layer=layer):
            layer.update(parameters)
            return layer(x)[0].sum()

        def forward(layer=layer, x=x):
            mx.eval(layer(x)[0])

        def both(layer=layer, x=x, gradient=mx.value_and_grad(loss, argnums=(0, 1))):  # x's too, as the suite
            mx.eval(gradient(layer.trainable_parameters(), x))

        shape = (steps, batch, input_size, hidden)
        compare(f"{kind} forward {shape}", {"base": (base, forward), "variant": (variant, forward)})
        compare(f"{kind} forward+backward {shape}", {"base": (base, both), "variant": (variant, both)})


def stream_cases(base, variant) -> None:
    import mlx.core as mx

    import seqlib.nn

    for hidden in (128, 512):
        cell = seqlib.nn.LSTMCell(hidden, hidden)
        inputs = [mx.random.normal((1, hidden)) for _ in range(50)]
        mx.eval(cell.parameters(), inputs)

        def stream(cell=cell, inputs=inputs):
            state = None
            for x in inputs:
                state = cell(x, state)
                mx.eval(state)

        compare(f"LSTMCell H={hidden}, 50 streamed steps", {"base": (base, stream), "variant": (variant, stream)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "loop", "layer", "stream"])
    parser.add_argument("paths", nargs="+", help="build: VARIANT_DIR OUTPUT.so; the others: VARIANT.so")
    parser.add_argument("--base", help="another variant's .so to compare against (default: this checkout's build)")
    parser.add_argument("--kind", default="LSTM", choices=["LSTM", "GRU"])
    args = parser.parse_args()
    if args.command == "build":
        if len(args.paths) != 2:
            sys.exit("build needs VARIANT_DIR OUTPUT.so")
        return build(Path(args.paths[0]), Path(args.paths[1]))
    import seqlib
    from seqlib import native
    from seqlib.bench import keep_large_buffers

    seqlib.route_mlx_blas()
    keep_large_buffers()
    if not native.available():
        sys.exit(f"seqlib's C++ primitives are not available here: {native.reason()}")
    base = load(args.base) if args.base else native.extension()
    variant = load(args.paths[0])
    if args.command == "loop":
        loop_cases(base, variant)
    elif args.command == "layer":
        layer_cases(base, variant, args.kind)
    else:
        stream_cases(base, variant)


if __name__ == "__main__":
    main()
