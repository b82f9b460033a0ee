"""Start and run Jupyter kernels many times, as the book build does, and report stalls.

Each run executes one notebook top to bottom through nbclient (as myst-nb does in the book build)
with the kernel manager configured as the book build configures it (``book/_ext/book_kernels.py``),
or, with ``--stock-client``, with jupyter_client's own client (the one that stalls).
Runs go on in ``--parallel`` worker processes at once. A run that takes more than ``--stall-factor``
times the median run, or that hits ``--timeout``, is a stall; the script exits 1 if there was one.

    .venv/bin/python tools/kernel_stress.py --runs 50 --parallel 2      # as ``make kernel-stress``
    .venv/bin/python tools/kernel_stress.py --stock-client              # before the fix: stalls
    .venv/bin/python tools/kernel_stress.py --log-dir /tmp/logs         # every message, a log per run

A stalled run's log shows which message came late: the stall of issue 27 was an ``execute_reply``
that the kernel sent at once and the client saw only at its timeout (see book/_ext/book_kernels.py).
Chapter 4 is the default notebook because its ``interact`` is the kind of cell that stalled.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))  # book_kernels, as the book build loads it


def run_once(notebook: str, timeout: int, encryption: str | None, log_dir: str | None,
             stock_client: bool) -> tuple[float, str]:
    """Execute ``notebook`` once in a fresh kernel; return (seconds, "" or the error)."""
    import logging
    import os
    import tempfile

    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    import book_kernels

    book_kernels.configure_kernel_manager(receiving_channels=not stock_client)
    if encryption is not None:  # override the book's choice, for the before/after comparison
        KernelManager.transport_encryption.default_value = encryption
    nb = nbformat.read(notebook, as_version=4)
    extra = {}
    if log_dir:  # every message of client and kernel, timestamped, into one file per run
        log_file = tempfile.NamedTemporaryFile("w", dir=log_dir, suffix=".log", delete=False)
        os.dup2(log_file.fileno(), 2)  # the kernel inherits our stderr
        handler = logging.StreamHandler(log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d client %(name)s %(message)s", "%H:%M:%S"))
        logger = logging.getLogger(f"stress{os.getpid()}")
        logger.handlers[:] = [handler]
        logger.setLevel(logging.DEBUG)
        extra = {"log": logger, "extra_arguments": ["--debug"]}
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(Path(notebook).parent)}}, **extra)
    start = time.perf_counter()
    error = ""
    try:
        client.execute()
    except Exception as exc:  # a timeout or a lost kernel is what we are looking for
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    seconds = time.perf_counter() - start
    if log_dir:
        print(f"run took {seconds:.2f} s {error}", file=log_file, flush=True)
        log_file.close()
    return seconds, error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notebook", default=str(ROOT / "chapters" / "04_lstm_one_unit.ipynb"))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=60, help="seconds per cell before a run counts as stalled")
    parser.add_argument("--stall-factor", type=float, default=3.0)
    parser.add_argument("--encryption", choices=("disabled", "auto"), default=None,
                        help="CurveZMQ transport encryption (default: whatever the book build uses)")
    parser.add_argument("--stock-client", action="store_true", help="jupyter_client's own kernel client")
    parser.add_argument("--log-dir", default=None, help="write client and kernel debug logs here, a file per run")
    args = parser.parse_args(argv)

    times, failures = [], []
    with ProcessPoolExecutor(max_workers=args.parallel) as pool:
        arguments = (args.notebook, args.timeout, args.encryption, args.log_dir, args.stock_client)
        futures = [pool.submit(run_once, *arguments) for _ in range(args.runs)]
        for index, future in enumerate(futures, 1):
            seconds, error = future.result()
            times.append(seconds)
            if error:
                failures.append((index, error))
            print(f"run {index:3d}: {seconds:7.2f} s {error}", flush=True)

    median = statistics.median(times)
    stalls = [(i, t) for i, t in enumerate(times, 1) if t > args.stall_factor * median]
    print(f"\n{args.runs} runs of {Path(args.notebook).name}, {args.parallel} at once: "
          f"median {median:.2f} s, max {max(times):.2f} s, "
          f"{len(stalls)} over {args.stall_factor:g}x the median, {len(failures)} failed")
    for index, error in failures:
        print(f"  run {index} failed: {error}")
    return 1 if stalls or failures else 0


if __name__ == "__main__":
    sys.exit(main())
