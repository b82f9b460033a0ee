"""Run a test case in a child process, so that a segfault fails one test instead of killing the run.

MLX's gathers and scatters do not check bounds: an unchecked index can read or
write outside a buffer and crash the interpreter.  The robustness suite calls
each malformed input through :func:`run_isolated`, which executes a
module-level function in a long-lived worker process (started once, restarted
after a crash) and returns an :class:`Outcome`:

- ``"returned"``: the function returned; ``value`` holds its result with every
  ``mx.array`` turned into a NumPy array (trees of tuples, lists, dicts kept);
- ``"raised"``: it raised; ``error_type`` (the class name), ``error_bases``
  (which of ValueError/IndexError/TypeError it is) and ``message``;
- ``"crashed"``: the worker died (``signal`` says how) or hung past the timeout.

The function runs with ``tests/`` on ``sys.path`` and ``seqlib`` imported first,
as in the parent.  Arguments and results travel by pickle, so pass plain data
(ints, lists, NumPy arrays) and build MLX arrays inside the function.

:func:`assert_clear_error` is the suite's one assertion for bad input: a
ValueError, IndexError or TypeError raised at the call, whose message is
seqlib's own (not MLX's ``[op] ...`` text) and names what it should.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import os
import pickle
import re
import select
import signal as signals
import struct
import subprocess
import sys
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
CLEAR_ERRORS = (ValueError, IndexError, TypeError)
# MLX's own messages start with the op's name in brackets: "[take] ...", "[broadcast_shapes] ..."
MLX_INTERNAL = re.compile(r"^\s*\[\w+\]")


@dataclasses.dataclass
class Outcome:
    kind: str  # "returned", "raised" or "crashed"
    value: object = None
    error_type: str = ""
    error_bases: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    signal: str = ""

    def __str__(self) -> str:
        if self.kind == "returned":
            return f"returned {_summary(self.value)}"
        if self.kind == "raised":
            return f"raised {self.error_type}: {self.message}"
        return f"crashed ({self.signal})"


def _summary(value) -> str:
    import numpy as np

    if isinstance(value, np.ndarray):
        return f"array(shape={value.shape}, dtype={value.dtype})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_summary(item) for item in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_summary(item)}" for key, item in value.items()) + "}"
    return repr(value)[:200]


# ---------------------------------------------------------------- the parent's side


def _send(stream, payload) -> None:
    data = pickle.dumps(payload)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, count: int, deadline_s: float) -> bytes | None:
    chunks, remaining = [], count
    while remaining:
        ready, _, _ = select.select([fd], [], [], deadline_s)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, remaining)
        if not chunk:
            return None  # the worker is gone
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


class _Worker:
    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=TESTS_DIR.parent,
        )

    def call(self, module_file: str, name: str, args, kwargs, timeout_s: float) -> Outcome:
        try:
            _send(self.process.stdin, (module_file, name, args, kwargs))
            header = _read_exactly(self.process.stdout.fileno(), 8, timeout_s)
            body = header and _read_exactly(self.process.stdout.fileno(), struct.unpack("<Q", header)[0], timeout_s)
        except TimeoutError:
            self.stop()
            return Outcome("crashed", signal=f"no answer within {timeout_s:.0f} s")
        except BrokenPipeError:
            body = None
        if body is None:
            code = self.process.wait()
            how = f"killed by {signals.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            return Outcome("crashed", signal=how)
        return Outcome(**pickle.loads(body))

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()


_worker: _Worker | None = None


def _stop_worker() -> None:
    if _worker is not None:
        _worker.stop()


atexit.register(_stop_worker)


def run_isolated(function, *args, timeout_s: float = 120.0, **kwargs) -> Outcome:
    """Call the module-level ``function(*args, **kwargs)`` in the worker process and report what happened."""
    global _worker
    if _worker is None or not _worker.alive():
        _worker = _Worker()
    module_file = sys.modules[function.__module__].__file__
    return _worker.call(module_file, function.__qualname__, args, kwargs, timeout_s)


def assert_clear_error(outcome: Outcome, *names: str, allowed=CLEAR_ERRORS, case: object = "") -> None:
    """Fail unless ``outcome`` is one of ``allowed`` raised with seqlib's own message naming each of ``names``."""
    context = f" for {case!r}" if case != "" else ""
    assert outcome.kind == "raised", f"expected a clear error{context}, but the call {outcome}"
    allowed_names = {error.__name__ for error in allowed}
    assert allowed_names & set(outcome.error_bases), (
        f"expected one of {sorted(allowed_names)}{context}, got {outcome.error_type}: {outcome.message}\n"
        f"{outcome.traceback}"
    )
    assert not MLX_INTERNAL.match(outcome.message), (
        f"MLX's internal message reached the user{context}: {outcome.message}\n{outcome.traceback}"
    )
    for name in names:
        assert name in outcome.message, f"the message should name {name!r}{context}: {outcome.message}"


# ---------------------------------------------------------------- the worker's side


def _to_plain(value):
    import mlx.core as mx
    import numpy as np

    if isinstance(value, mx.array):
        if value.dtype == mx.bfloat16:
            value = value.astype(mx.float32)
        return np.array(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuples such as PackedSequence
        return tuple(_to_plain(item) for item in value)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_plain(item) for key, item in value.items()}
    if value is None or isinstance(value, (int, float, str, bool, np.ndarray, np.generic)):
        return value
    return repr(value)


def _load(module_file: str, cache: dict):
    if module_file not in cache:
        name = "isolated_" + Path(module_file).stem
        spec = importlib.util.spec_from_file_location(name, module_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cache[module_file] = module
    return cache[module_file]


def _serve() -> None:
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the library prints goes to stderr, never into the protocol
    channel_in = sys.stdin.buffer
    sys.path.insert(0, str(TESTS_DIR))
    import seqlib

    seqlib.route_mlx_blas()  # as in the parent (conftest)

    modules: dict = {}
    while True:
        header = channel_in.read(8)
        if len(header) < 8:
            return
        module_file, name, args, kwargs = pickle.loads(channel_in.read(struct.unpack("<Q", header)[0]))
        function = _load(module_file, modules)
        for part in name.split("."):
            function = getattr(function, part)
        try:
            outcome = Outcome("returned", value=_to_plain(function(*args, **kwargs)))
        except Exception as error:  # report every error; the parent decides which are acceptable
            bases = tuple(base.__name__ for base in CLEAR_ERRORS if isinstance(error, base))
            outcome = Outcome(
                "raised",
                error_type=type(error).__name__,
                error_bases=bases,
                message=str(error),
                traceback="".join(traceback.format_exception(error)[-6:]),
            )
        _send(channel_out, dataclasses.asdict(outcome))  # a dict: __main__.Outcome would not unpickle


if __name__ == "__main__":
    _serve()
