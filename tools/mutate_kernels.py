"""Mutation check of the Metal kernels: does a one-token change to a kernel make the emulation tests fail?

For each kernel (and the shared header) this makes mutants of its code (not its
comments): an arithmetic operator flipped, a comparison loosened or tightened,
an ``exp``/``tanh``/``sigmoid`` dropped, a constant nudged.  Each mutant is
written to a copy of ``metal_kernels/`` that seqlib reads through
``SEQLIB_KERNEL_DIR``, and ``pytest -m metal_emulation -x`` runs against it.  A
mutant the tests do not kill is printed: either a gap in the tests or an
equivalent mutant (same behaviour), to be judged by reading it.

    .venv/bin/python tools/mutate_kernels.py                 # 4 mutants per kernel, seeded
    .venv/bin/python tools/mutate_kernels.py --per-kernel 0  # every mutant (slow: ~8 s each)
    .venv/bin/python tools/mutate_kernels.py --kernel lstm_cell
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "metal_kernels"
MUTATIONS = [
    (r"(?<=[\w)\]] )\+(?= )", "-"),
    (r"(?<=[\w)\]] )-(?= )", "+"),
    (r"(?<=[\w)\]] )\*(?= )", "/"),
    (r"(?<= )/(?= )", "*"),
    (r"(?<= )<(?= )", "<="),
    (r"(?<= )<=(?= )", "<"),
    (r"(?<= )>(?= )", ">="),
    (r"(?<= )>=(?= )", ">"),
    (r"(?<= )==(?= )", "!="),
    (r"(?<= )!=(?= )", "=="),
    (r"\+= ", "-= "),
    (r"metal::exp\(", "("),
    (r"\btanh_of\(", "("),
    (r"\bsigmoid_of\(", "("),
    (r"\b1\.0f\b", "0.5f"),
    (r"\b32\b", "16"),
]


def code_spans(text: str):
    """(start, end) of every stretch of text outside comments."""
    position = 0
    for match in re.finditer(r"//[^\n]*", text):
        yield position, match.start()
        position = match.end()
    yield position, len(text)


def mutants(text: str):
    for pattern, replacement in MUTATIONS:
        for start, end in code_spans(text):
            for match in re.finditer(pattern, text[start:end]):
                at = start + match.start()
                mutated = text[:at] + replacement + text[at + len(match.group(0)):]
                line = text.count("\n", 0, at) + 1
                yield f"line {line}: {match.group(0).strip()!r} -> {replacement.strip()!r}", mutated


def run_tests(kernel_dir: Path) -> bool:
    """True if the emulation tests fail (the mutant is killed)."""
    env = dict(os.environ, SEQLIB_KERNEL_DIR=str(kernel_dir), SEQLIB_EMULATION_CACHE=str(kernel_dir / "cache"))
    command = [sys.executable, "-m", "pytest", "-m", "metal_emulation", "-x", "-q", "-p", "no:randomly", "tests"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    return result.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kernel", type=int, default=4, help="mutants per kernel (0: all)")
    parser.add_argument("--kernel", action="append", help="only these kernels (file stems)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = [*sorted(KERNELS.glob("*.metal")), KERNELS / "seqlib_math.h"]
    if args.kernel:
        files = [path for path in files if path.stem in args.kernel]
    rng = random.Random(args.seed)
    survivors, total, started = [], 0, time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "metal_kernels"
        shutil.copytree(KERNELS, copy)
        for path in files:
            original = path.read_text()
            chosen = list(mutants(original))
            if args.per_kernel and len(chosen) > args.per_kernel:
                chosen = rng.sample(chosen, args.per_kernel)
            for description, mutated in chosen:
                (copy / path.name).write_text(mutated)
                killed = run_tests(copy)
                total += 1
                print(f"{'killed  ' if killed else 'SURVIVED'} {path.name} {description}", flush=True)
                if not killed:
                    survivors.append(f"{path.name} {description}")
            (copy / path.name).write_text(original)
    elapsed = time.perf_counter() - started
    print(f"\n{total - len(survivors)} of {total} mutants killed in {elapsed:.0f} s")
    for survivor in survivors:
        print("  survived:", survivor)
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
