"""Quantized seqlib modules on the book's two real models: accuracy, memory, time per streaming step.

    .venv/bin/python tools/measure_quantized.py        (a few minutes on 2 cores)

- Chapter 16's speech detector (silero-vad's pretrained 16 kHz model, its LSTMCell(128, 128) in seqlib):
  the speech probability of each 32 ms chunk of the chapter's clip with the cell in float32 and with
  its matrices quantized to 8 and 4 bits; how many chunks change their decision at 0.5.
- Chapter 13's character model (Embedding, 2-layer LSTM(32 -> 128), Linear head), trained as the
  chapter trains it: held-out perplexity in float32 and after ``mlx.nn.quantize`` (tables, recurrent
  layers and the head) at 8 and 4 bits.
- Memory of the parameters, and the time of one streaming step (batch 1, interleaved medians) of an
  LSTMCell at H = 128 and of a one-layer LSTM's ``step`` at H = 512, float32 against quantized.

The chapters' own code cells run here (plots and widgets left out), so the models are the chapters'.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import seqlib
from seqlib.bench import print_versions

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def _quiet(namespace: dict) -> None:
    """Listings, widgets, animations and figures do nothing here (the cells still define what they compute)."""
    import ipywidgets
    import matplotlib.pyplot as plt

    from seqlib import plotting

    nothing = lambda *args, **kwargs: None
    namespace["show_source"] = nothing
    ipywidgets.interact = nothing
    plotting.animation = nothing
    plt.show = lambda *args, **kwargs: plt.close("all")


def run_chapter(name: str, last_cell: int) -> dict:
    """Execute the code cells 0..last_cell of chapters/<name>.ipynb, with nothing displayed."""
    cells = json.loads((CHAPTERS / f"{name}.ipynb").read_text())["cells"][: last_cell + 1]
    namespace = {"__name__": f"chapter_{name}"}
    cwd = os.getcwd()
    os.chdir(CHAPTERS)  # the chapters read ../book/assets
    try:
        for cell in cells:
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), f"{name}.ipynb", "exec"), namespace)
                _quiet(namespace)
    finally:
        os.chdir(cwd)
    return namespace


def parameter_bytes(module) -> int:
    return sum(value.nbytes for _, value in tree_flatten(module.parameters()))


def speech_detector(bits_list):
    chapter = run_chapter("16_streaming_speech_detection", 24)
    float_cell, chunks = chapter["cell"], chapter["chunks"]
    reference, _ = chapter["stream"](chunks)
    print(f"\nSpeech detector (chapter 16): {len(chunks)} chunks; float32 cell "
          f"{parameter_bytes(float_cell) / 1024:.0f} KiB")
    for bits in bits_list:
        chapter["cell"] = float_cell.to_quantized(group_size=64, bits=bits)  # vad_step reads the global
        probabilities, _ = chapter["stream"](chunks)
        flips = int(np.sum((probabilities >= 0.5) != (reference >= 0.5)))
        print(f"  {bits}-bit cell ({parameter_bytes(chapter['cell']) / 1024:.0f} KiB): "
              f"max |P - P_float| = {np.abs(probabilities - reference).max():.4f}, "
              f"decisions changed at 0.5: {flips} of {len(chunks)}")
    chapter["cell"] = float_cell


def character_model(bits_list):
    chapter = run_chapter("13_character_language_model", 14)
    model = chapter["lstm_model"]
    chapter["train"](model)
    evaluate = run_chapter_function(chapter, "13_character_language_model", 18, "evaluate")
    float_ppl = evaluate(model)[0]
    float_weights = dict(tree_flatten(model.parameters()))
    print(f"\nCharacter model (chapter 13, trained {chapter['STEPS']} steps): held-out perplexity "
          f"{float_ppl:.3f} in float32 ({parameter_bytes(model) / 1024:.0f} KiB)")
    for bits in bits_list:
        quantized = chapter["CharLanguageModel"](len(chapter["vocab"]), kind="lstm")
        quantized.update(model.parameters())
        nn.quantize(quantized, group_size=32, bits=bits)
        ppl = evaluate(quantized)[0]
        print(f"  {bits}-bit (mlx.nn.quantize: table, LSTM, head; {parameter_bytes(quantized) / 1024:.0f} KiB): "
              f"perplexity {ppl:.3f} ({(ppl / float_ppl - 1) * 100:+.2f}%)")
    assert all(np.array_equal(np.array(value), np.array(float_weights[key]))
               for key, value in tree_flatten(model.parameters()))  # fmt: skip


def run_chapter_function(chapter: dict, name: str, cell_index: int, function: str):
    """Define one function of a later cell (without running the rest of that cell) in ``chapter``."""
    source = "".join(json.loads((CHAPTERS / f"{name}.ipynb").read_text())["cells"][cell_index]["source"])
    definitions = source.split("\n\n")
    namespace = chapter
    for block in definitions:
        if block.startswith(f"def {function}(") or block.startswith("validation_windows ="):
            exec(block, namespace)
    return namespace[function]


def median_step_us(step, repeats=200) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def streaming_steps(bits_list):
    print("\nOne streaming step at batch 1 (interleaved medians of 200, microseconds):")
    for label, make, hidden in (("LSTMCell", lambda h: seqlib.nn.LSTMCell(h, h), 128),
                                ("LSTM(num_layers=1).step", lambda h: seqlib.nn.LSTM(h, h), 512)):  # fmt: skip
        mx.random.seed(0)
        float_module = make(hidden)
        modules = {"float32": float_module, **{f"{bits}-bit": float_module.to_quantized(64, bits)
                                              for bits in bits_list}}  # fmt: skip
        x = mx.random.normal((1, hidden))
        mx.eval(x, *(module.parameters() for module in modules.values()))
        steps = {}
        for name, module in modules.items():
            call = module.step if label.endswith("step") else module

            def step(call=call, x=x):
                mx.eval(call(x))

            step()
            steps[name] = step
        times = {name: [] for name in steps}
        for _ in range(5):  # interleaved rounds
            for name, step in steps.items():
                times[name].append(median_step_us(step, 40))
        base = statistics.median(times["float32"])
        row = ", ".join(f"{name} {statistics.median(values):.0f} ({statistics.median(values) / base:.2f}x, "
                        f"{parameter_bytes(modules[name]) / 1024:.0f} KiB)"
                        for name, values in times.items())  # fmt: skip
        print(f"  {label}, H = {hidden}: {row}")


def main() -> None:
    seqlib.route_mlx_blas()
    print_versions()
    print(f"native primitives: {seqlib.native.available()}")
    bits_list = (8, 4)
    speech_detector(bits_list)
    character_model(bits_list)
    streaming_steps(bits_list)


if __name__ == "__main__":
    sys.exit(main())
