"""Mutation check of the Metal kernels: does a one-token change to a kernel make its emulation tests fail?

For each kernel (and the shared header) this makes every mutant of its code (not
its comments): an arithmetic operator flipped, a comparison loosened or
tightened, ``==``/``!=`` swapped, an ``exp``/``tanh``/``sigmoid`` call dropped, a
constant nudged.  Each mutant runs only the tests that exercise its kernel
(:data:`FOCUSED_TESTS`, a ``-k`` expression over ``tests/test_metal_kernels.py``),
with ``-x`` so a killed mutant stops at its first failing test.

Speed: pytest and torch take seconds to start, so each worker process starts
once, imports them, and runs ``pytest.main`` in-process for mutant after mutant
(seqlib's kernel cache is cleared between runs; the emulation caches compiled
code by the hash of its text, in one cache folder for the whole run, so
unmutated kernels compile once).  Every worker has its own copy of
``metal_kernels/``, read through ``SEQLIB_KERNEL_DIR``.  A mutant that crashes
its worker or runs past ``--timeout``, twice (the second time in a fresh
worker), counts as killed: a real run would crash or hang too.  A worker whose
mutant wrote past a buffer (its memory may be damaged) is replaced before the
next mutant.

Each mutant is printed with its outcome, its time and the test that killed it;
the last lines are the score, ``K of N mutants killed``, and the survivors.  A
survivor listed in ``tools/mutation_survivors.md`` (with the argument why it is
equivalent) is reported as such; any other survivor is a gap in the tests and
makes the exit status 1.  Rows of that file that name no current mutant, or a
mutant that was killed, are reported too (a kernel was edited: check them).

    .venv/bin/python tools/mutate_kernels.py                          # 4 mutants per kernel, seeded
    .venv/bin/python tools/mutate_kernels.py --per-kernel 0           # every mutant (526: 20-40 min on one shared core)
    .venv/bin/python tools/mutate_kernels.py --per-kernel 0 --jobs 2  # in two worker processes
    .venv/bin/python tools/mutate_kernels.py --per-kernel 0 --kernel lstm_cell --kernel seqlib_math
    .venv/bin/python tools/mutate_kernels.py --per-kernel 0 --results mutants.jsonl  # one JSON line per mutant
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import random
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "metal_kernels"
SURVIVORS_FILE = Path(__file__).resolve().with_name("mutation_survivors.md")
TEST_FILE = "tests/test_metal_kernels.py"
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

# The tests that exercise each kernel, as a pytest -k expression over TEST_FILE (which runs them in file order:
# the kernel's own tests against torch first, then its half-precision tests, then the modules on top of it).
_CELLS = "cells_on_the_metal_path or large_batches"
_LOOKUPS = "lookup_kernels or half_precision_embedding_gather or embedding_on_the_metal_path or sparse_gradients"
_BAGS = "bag_kernels or max_bags or half_precision_embedding_bag or embedding_bag_on_the_metal_path"
FOCUSED_TESTS = {
    "lstm_cell": f"lstm_cell or {_CELLS}",
    "lstm_cell_backward": f"lstm_cell or {_CELLS}",
    "gru_cell": f"gru_cell or {_CELLS}",
    "gru_cell_backward": f"gru_cell or {_CELLS}",
    "rnn_cell": f"rnn_cell or {_CELLS}",
    "rnn_cell_backward": f"rnn_cell or {_CELLS}",
    "lstm_sequence": "lstm_sequence and simd or recurrent_layers_on_the_metal_path",
    "lstm_sequence_simple": "lstm_sequence and simple",
    "gru_sequence": "gru_sequence or recurrent_layers_on_the_metal_path",
    "embedding_gather": _LOOKUPS,
    "embedding_backward": _LOOKUPS,
    "embedding_renorm": "renorm",
    "embedding_bag": _BAGS,
    "embedding_bag_backward": _BAGS,
    "embedding_bag_per_sample_weights_backward": _BAGS,
    # the header: sigmoid_of and tanh_of (every gate kernel), MODE_* (bags) and NORM_* (renorm)
    "seqlib_math": "lstm_cell_forward or gru_cell_forward or rnn_cell_forward or bag_kernels_forward or renorm_scales",
}
PYTEST_FLAGS = ["-x", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:nbval"]
RECYCLE_AFTER = 100  # mutants per worker process (each leaves its compiled libraries loaded)


@dataclass(frozen=True)
class Mutant:
    file: str  # e.g. "lstm_cell.metal"
    line: int
    column: int
    token: str
    replacement: str
    text: str  # the whole mutated file

    @property
    def kernel(self) -> str:
        return self.file.split(".")[0]

    @property
    def name(self) -> str:
        """How the mutant is printed, and listed in mutation_survivors.md: ``file line:column token -> replacement``."""
        return f"{self.file} {self.line}:{self.column} {self.token} -> {self.replacement}"


def code_spans(text: str):
    """(start, end) of every stretch of text outside comments."""
    position = 0
    for match in re.finditer(r"//[^\n]*", text):
        yield position, match.start()
        position = match.end()
    yield position, len(text)


def mutants(file: str, text: str) -> list[Mutant]:
    """Every mutant of ``text`` (the contents of ``metal_kernels/<file>``), in MUTATIONS order."""
    found = []
    for pattern, replacement in MUTATIONS:
        for start, end in code_spans(text):
            for match in re.finditer(pattern, text[start:end]):
                at = start + match.start()
                mutated = text[:at] + replacement + text[at + len(match.group(0)):]
                line = text.count("\n", 0, at) + 1
                column = at - (text.rfind("\n", 0, at) + 1) + 1
                found.append(Mutant(file, line, column, match.group(0).strip(), replacement.strip(), mutated))
    return found


def argued_equivalent(path: Path = SURVIVORS_FILE) -> set[str]:
    """Names of the mutants that mutation_survivors.md argues are equivalent: its table rows
    ``| kernel file | line:column | `token` -> `replacement` | why |``."""
    if not path.exists():
        return set()
    names = set()
    for row in path.read_text().splitlines():
        cells = [cell.strip().replace("`", "") for cell in row.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"\d+:\d+", cells[1]):
            names.add(f"{cells[0]} {cells[1]} {' '.join(cells[2].split())}")
    return names


# ----------------------------------------------------------------- the worker: pytest in-process, mutant after mutant


# Failures after which the worker's memory may be corrupt (a write past a buffer's guard zone, a fault the
# emulation recovered from, fibers left waiting): the worker answers, then exits, and the next mutant gets a
# fresh one, so no mutant is judged in a process an earlier mutant damaged.
TAINTING_FAILURES = ("wrote outside output", "memory fault", "deadlock")


class _FirstFailure:
    """pytest plugin: the node id of the first test that failed, and whether it left the process suspect."""

    def __init__(self):
        self.nodeid = None
        self.tainted = False

    def pytest_runtest_logreport(self, report):
        if report.failed and self.nodeid is None:
            self.nodeid = report.nodeid
            self.tainted = any(words in report.longreprtext for words in TAINTING_FAILURES)


def serve(kernel_copy: Path, log: Path) -> None:
    """Worker loop: a JSON request per stdin line (file, text, -k expression); one JSON answer per line."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log, "a") as log_file:  # pytest's output (and the emulation's) goes to the log, not to answers
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
    import pytest
    import torch  # noqa: F401  (imported once here, not once per mutant)

    import seqlib  # noqa: F401

    forget_built_kernels = importlib.import_module("seqlib.kernels.runtime").forget_built_kernels
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        path = kernel_copy / request["file"]
        original = path.read_text()
        path.write_text(request["text"])
        forget_built_kernels()
        first_failure = _FirstFailure()
        print(f"\n===== {request['name']}", flush=True)
        started = time.perf_counter()
        try:
            code = pytest.main([TEST_FILE, "-k", request["tests"], *PYTEST_FLAGS], plugins=[first_failure])
        finally:
            path.write_text(original)
            forget_built_kernels()
        seconds = time.perf_counter() - started
        answer = {"exit": int(code), "failed": first_failure.nodeid, "seconds": seconds}
        answers.write(json.dumps({**answer, "tainted": first_failure.tainted}) + "\n")
        if first_failure.tainted:
            return


class Worker:
    """One worker process with its own copy of metal_kernels/, started on demand and restarted after a crash."""

    def __init__(self, folder: Path, originals: dict[str, str], cache: Path):
        self.folder, self.originals, self.cache = folder, originals, cache
        self.kernel_copy = folder / "metal_kernels"
        self.process: subprocess.Popen | None = None
        self.served = 0

    def _start(self) -> None:
        self.kernel_copy.mkdir(parents=True, exist_ok=True)
        for file, text in self.originals.items():  # also undoes the mutant of a worker that died mid-run
            (self.kernel_copy / file).write_text(text)
        environment = dict(os.environ, SEQLIB_KERNEL_DIR=str(self.kernel_copy), SEQLIB_EMULATION_CACHE=str(self.cache),
                           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")  # fmt: skip
        environment.pop("SEQLIB_BACKEND", None)
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(self.kernel_copy),
                   "--log", str(self.folder / "pytest.log")]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=ROOT, env=environment, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.served = 0
        if "ready" not in self._answer(timeout=300):
            raise RuntimeError(f"a mutation worker did not start; see {self.folder / 'pytest.log'}")

    def _answer(self, timeout: float) -> dict:
        """The worker's next answer; ``{"died": True}`` if it exited, ``{"silent": True}`` after ``timeout`` s."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return {"silent": True}
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"died": True}

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def run(self, mutant_name: str, file: str, text: str, tests: str, timeout: float) -> dict:
        """Run ``tests`` against ``file`` replaced by ``text``: {"outcome", "failed", "seconds"}.  A crash or a
        timeout is tried once more in a fresh worker (an earlier mutant may have damaged this one's memory)."""
        result = self._run_once(mutant_name, file, text, tests, timeout)
        if result["outcome"] in ("crashed", "timeout"):
            result = self._run_once(mutant_name, file, text, tests, timeout)
        return result

    def _run_once(self, mutant_name: str, file: str, text: str, tests: str, timeout: float) -> dict:
        if self.process is None or self.served >= RECYCLE_AFTER:
            self.stop()
            self._start()
        started = time.perf_counter()
        request = {"name": mutant_name, "file": file, "text": text, "tests": tests}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.served += 1
        answer = self._answer(timeout)
        seconds = time.perf_counter() - started
        if "exit" not in answer:
            self.stop()
            return {"outcome": "crashed" if "died" in answer else "timeout", "failed": None, "seconds": seconds}
        if answer["tainted"]:
            self.stop()  # it has exited; the next mutant starts a fresh worker
        outcomes = {0: "survived", 1: "killed"}
        if answer["exit"] not in outcomes:  # collection errors, no tests selected: the map or the tests are broken
            log = self.folder / "pytest.log"
            raise RuntimeError(f"pytest exited with {answer['exit']} for {mutant_name}; see {log}")
        return {"outcome": outcomes[answer["exit"]], "failed": answer["failed"], "seconds": seconds}


# ----------------------------------------------------------------- the run


def chosen_mutants(files: list[Path], per_kernel: int, seed: int) -> list[Mutant]:
    rng = random.Random(seed)
    chosen = []
    for path in files:
        found = mutants(path.name, path.read_text())
        if per_kernel and len(found) > per_kernel:
            found = rng.sample(found, per_kernel)
        chosen.extend(found)
    return chosen


def check_baseline(worker: Worker, files: list[Path], originals: dict[str, str], timeout: float) -> dict[str, float]:
    """Each kernel's focused tests must pass on the unmutated kernels (they also compile them into the cache)."""
    seconds = {}
    for path in files:
        result = worker.run(f"{path.name} (unmutated)", path.name, originals[path.name], FOCUSED_TESTS[path.stem],
                            timeout)  # fmt: skip
        if result["outcome"] != "survived":
            raise SystemExit(f"the focused tests of {path.name} fail on the unmutated kernels "
                             f"({result['outcome']}: {result['failed']}); fix them first")  # fmt: skip
        seconds[path.stem] = result["seconds"]
        print(f"baseline {result['seconds']:6.1f} s  {path.name}: -k {FOCUSED_TESTS[path.stem]!r}", flush=True)
    return seconds


def run_all(chosen: list[Mutant], workers: list[Worker], timeout: float, results_file) -> list[tuple[Mutant, dict]]:
    """Run every mutant on the first free worker; print each as it finishes."""
    pending: queue.Queue[Mutant] = queue.Queue()
    for mutant in chosen:
        pending.put(mutant)
    results, lock = [], threading.Lock()

    def drain(worker: Worker) -> None:
        while True:
            try:
                mutant = pending.get_nowait()
            except queue.Empty:
                return
            result = worker.run(mutant.name, mutant.file, mutant.text, FOCUSED_TESTS[mutant.kernel], timeout)
            with lock:
                results.append((mutant, result))
                by = f"  ({result['failed'].split('::')[-1]})" if result["failed"] else ""
                label = "SURVIVED" if result["outcome"] == "survived" else result["outcome"]
                print(f"{len(results):4d}/{len(chosen)} {label:8} {result['seconds']:6.1f} s  {mutant.name}{by}",
                      flush=True)  # fmt: skip
                if results_file is not None:
                    record = {"mutant": mutant.name, "kernel": mutant.file, "line": mutant.line,
                              "column": mutant.column, "mutation": f"{mutant.token} -> {mutant.replacement}",
                              **result}  # fmt: skip
                    results_file.write(json.dumps(record) + "\n")
                    results_file.flush()

    threads = [threading.Thread(target=drain, args=(worker,)) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kernel", type=int, default=4, help="mutants per kernel, drawn at random (0: all)")
    parser.add_argument("--kernel", action="append", help="only these kernels (file stems; repeat the option)")
    parser.add_argument("--seed", type=int, default=0, help="for drawing --per-kernel mutants")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes run in parallel (default 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a mutant counts as hanging")
    parser.add_argument("--results", type=Path, help="also write one JSON line per mutant to this file")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # internal: run as a worker
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.log)
        return
    if args.jobs < 1:
        parser.error(f"--jobs: expected at least 1, got {args.jobs}")
    files = [*sorted(KERNELS.glob("*.metal")), KERNELS / "seqlib_math.h"]
    if args.kernel:
        unknown = set(args.kernel) - {path.stem for path in files}
        if unknown:
            parser.error(f"--kernel: no kernel called {', '.join(sorted(unknown))}")
        files = [path for path in files if path.stem in args.kernel]
    missing = {path.stem for path in files} - set(FOCUSED_TESTS)
    if missing:
        raise SystemExit(f"FOCUSED_TESTS has no tests for {', '.join(sorted(missing))}")
    originals = {path.name: path.read_text() for path in KERNELS.iterdir() if path.suffix in (".metal", ".h")}
    chosen = chosen_mutants(files, args.per_kernel, args.seed)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="seqlib-mutants-") as scratch:
        cache = Path(scratch) / "emulation-cache"
        workers = [Worker(Path(scratch) / f"worker{index}", originals, cache) for index in range(args.jobs)]
        results_file = open(args.results, "w") if args.results else None
        try:
            check_baseline(workers[0], files, originals, args.timeout)
            results = run_all(chosen, workers, args.timeout, results_file)
        finally:
            for worker in workers:
                worker.stop()
            if results_file is not None:
                results_file.close()
    elapsed = time.perf_counter() - started

    survivors = sorted((mutant for mutant, result in results if result["outcome"] == "survived"),
                       key=lambda mutant: (mutant.file, mutant.line, mutant.column))  # fmt: skip
    argued = argued_equivalent()
    unexplained = [mutant for mutant in survivors if mutant.name not in argued]
    print(f"\n{len(results) - len(survivors)} of {len(results)} mutants killed "
          f"({elapsed:.0f} s, --jobs {args.jobs})")  # fmt: skip
    print(f"{len(survivors) - len(unexplained)} survivors argued equivalent in {SURVIVORS_FILE.name}, "
          f"{len(unexplained)} unexplained")  # fmt: skip
    for mutant in survivors:
        print(f"  {'equivalent' if mutant.name in argued else 'UNEXPLAINED'}: {mutant.name}")
    every_mutant = {mutant.name for path in files for mutant in mutants(path.name, originals[path.name])}
    killed = {mutant.name for mutant, result in results if result["outcome"] != "survived"}
    for name in sorted(argued & killed):
        print(f"  {SURVIVORS_FILE.name} lists as equivalent, but the tests kill it: {name}")
    for name in sorted(name for name in argued - every_mutant if name.split()[0] in {p.name for p in files}):
        print(f"  {SURVIVORS_FILE.name} lists a mutant the kernel no longer has: {name}")
    sys.exit(1 if unexplained else 0)


if __name__ == "__main__":
    main()
