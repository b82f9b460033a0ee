"""Data the book trains on, made from nothing but what is installed: no downloads.

- :func:`adding_problem`: the classic long-range memory task for recurrent
  networks (Hochreiter & Schmidhuber 1997).  Each sequence is T steps of two
  features: a random value in [0, 1) and a marker that is 1 at exactly two
  steps, one in each half of the sequence.  The target is the sum of the two
  marked values.  A model that ignores the markers does best by predicting the
  mean, 1.0, for a mean squared error of Var(u1 + u2) = 1/6; beating that
  means carrying a value across up to T - 1 steps.
- :func:`python_source_tokens`: a real text corpus on every machine, the words
  of Python's own standard library (identifiers, keywords, and the English of
  its comments and docstrings), in a fixed file order.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np

from seqlib._checks import check_positive_ints

__all__ = [
    "ADDING_PROBLEM_BASELINE_MSE", "adding_problem", "python_source_tokens", "source_words", "stdlib_source_files",
]  # fmt: skip

ADDING_PROBLEM_BASELINE_MSE = 1 / 6  # always predicting 1.0: the variance of a sum of two U(0, 1)

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def adding_problem(num_sequences: int, length: int, rng: np.random.Generator | int | None = 0):
    """A batch of the adding problem: ``inputs`` (B, T, 2) float32 and ``targets`` (B,) float32.

    ``inputs[..., 0]`` are values drawn uniformly from [0, 1); ``inputs[..., 1]``
    marks one step in the first half ``[0, T // 2)`` and one in the second half
    ``[T // 2, T)``.  ``targets`` is the sum of the two marked values.  The batch
    is batch-first.  ``rng`` is a NumPy Generator (pass the same one to draw a
    fresh batch on every call) or a seed.
    """
    check_positive_ints(num_sequences=num_sequences, length=length)
    if length < 2:
        raise ValueError(f"length: expected at least 2 steps (one marker in each half), got {length}")
    try:
        rng = np.random.default_rng(rng)
    except (TypeError, ValueError) as error:
        expected = "a numpy.random.Generator, a non-negative int seed or None"
        raise type(error)(f"rng: expected {expected}, got {rng!r}") from error
    values = rng.uniform(0.0, 1.0, (num_sequences, length)).astype(np.float32)
    first = rng.integers(0, length // 2, num_sequences)
    second = rng.integers(length // 2, length, num_sequences)
    markers = np.zeros((num_sequences, length), np.float32)
    rows = np.arange(num_sequences)
    markers[rows, first] = 1.0
    markers[rows, second] = 1.0
    targets = values[rows, first] + values[rows, second]
    return mx.array(np.stack([values, markers], axis=-1)), mx.array(targets)


def stdlib_source_files() -> list[Path]:
    """The ``.py`` files at the top level of this Python's standard library, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def python_source_tokens(max_files: int | None = None) -> list[str]:
    """Every identifier-like word (``[A-Za-z_][A-Za-z0-9_]*``) of the standard library's top-level modules.

    Words come file by file in :func:`stdlib_source_files` order, in the order
    they appear; case is kept (``True`` and ``true`` are different words).
    ``max_files`` takes only the first files.  Which words there are depends on
    the Python version, since each release edits its standard library.
    """
    if max_files is not None:
        check_positive_ints(max_files=max_files)
    files = stdlib_source_files()[:max_files]
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library folder {sysconfig.get_paths()['stdlib']}")
    words: list[str] = []
    for path in files:
        words += source_words(path.read_text(encoding="utf-8", errors="replace"))
    return words


def source_words(text: str) -> list[str]:
    """The identifier-like words of ``text`` in order: maximal runs of ASCII letters, digits and ``_``
    that do not start with a digit (``3abc`` gives ``abc``)."""
    return _WORD.findall(text)
