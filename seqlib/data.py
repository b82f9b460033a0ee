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
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from seqlib._checks import as_int_vector, check_nonnegative_ints, check_positive_ints

__all__ = [
    "ADDING_PROBLEM_BASELINE_MSE", "CHARACTER_CORPUS_MODULES", "CharacterVocabulary", "adding_problem",
    "character_corpus", "python_source_tokens", "source_words", "split_by_file", "stdlib_source_files",
    "tbptt_batches",
]  # fmt: skip

#: The adding problem's baseline, the MSE of always predicting 1.0 (the variance of a sum of two U(0, 1)).
ADDING_PROBLEM_BASELINE_MSE = 1 / 6

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


#: Pure-Python modules present in every CPython from 3.9 to 3.13 (none deprecated for removal), in name
#: order: the files of :func:`character_corpus`.  Their text changes from release to release, so what a
#: model learns from them is a claim about "Python's own source", not a number that every Python reproduces.
#:
#: :meta hide-value:
CHARACTER_CORPUS_MODULES = (
    "abc", "bisect", "cmd", "code", "codeop", "colorsys", "contextlib", "copy", "copyreg", "csv",
    "fnmatch", "functools", "genericpath", "glob", "heapq", "hmac", "keyword", "linecache", "numbers",
    "operator", "posixpath", "queue", "reprlib", "sched", "secrets", "shlex", "stat", "string",
    "textwrap", "timeit", "types",
)  # fmt: skip


def character_corpus(modules: Sequence[str] = CHARACTER_CORPUS_MODULES) -> list[tuple[str, str]]:
    """The source text of the standard library's top-level ``modules``, as ``(module name, text)`` pairs.

    The default is :data:`CHARACTER_CORPUS_MODULES`, a fixed list of small modules that every recent
    CPython ships (a few hundred KB in all), so the selection does not depend on the machine; the
    text does depend on the Python version.  Files are read as UTF-8, in the order given.
    """
    if isinstance(modules, str) or not isinstance(modules, Sequence):
        raise TypeError(f"modules: expected a sequence of module names, got {type(modules).__name__}")
    if not modules:
        raise ValueError("modules: expected at least one module name, got none")
    folder = Path(sysconfig.get_paths()["stdlib"])
    corpus = []
    for name in modules:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"modules: expected module names such as 'copy', got {name!r}")
        path = folder / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"modules: no top-level module {name!r} in the standard library folder {folder}")
        corpus.append((name, path.read_text(encoding="utf-8")))
    return corpus


def split_by_file(files: Sequence, validation_every: int = 5) -> tuple[list, list]:
    """Split ``files`` (any sequence, e.g. :func:`character_corpus`'s pairs) into ``(train, validation)``.

    Every ``validation_every``-th file (positions ``k - 1, 2k - 1, ...``) is held out whole, so no
    validation text shares a file with training text; nothing is random.  Both parts keep the order
    of ``files``.  At least one file must land in each part.
    """
    check_positive_ints(validation_every=validation_every)
    if isinstance(files, str) or not isinstance(files, Sequence):
        raise TypeError(f"files: expected a sequence (list or tuple), got {type(files).__name__}")
    if validation_every < 2:
        raise ValueError(
            f"validation_every: expected at least 2 (1 would leave no training files), got {validation_every}"
        )
    if len(files) < validation_every:
        raise ValueError(
            f"files: expected at least validation_every={validation_every} files to hold one out, got {len(files)}"
        )
    train = [item for position, item in enumerate(files) if (position + 1) % validation_every]
    validation = [item for position, item in enumerate(files) if not (position + 1) % validation_every]
    return train, validation


class CharacterVocabulary:
    """Characters as integer ids: ``0`` is the unknown symbol, ``1..`` the characters seen, sorted.

    ``CharacterVocabulary(text, min_count=1)`` keeps every character that occurs at least
    ``min_count`` times in ``text`` (the training text: a character seen only in validation maps
    to the unknown id).  ``encode(text)`` gives an int32 NumPy array (N,), ``decode(ids)`` the string,
    with :attr:`UNKNOWN` for id 0.  ``chars[i]`` is id ``i``'s character; ``len(vocab)`` the number of ids.
    """

    UNKNOWN = "\ufffd"  # the Unicode replacement character, shown for id 0

    def __init__(self, text: str, min_count: int = 1):
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        check_positive_ints(min_count=min_count)
        counts = Counter(text)
        kept = sorted(char for char, count in counts.items() if count >= min_count and char != self.UNKNOWN)
        if not kept:
            raise ValueError(f"text: no character occurs at least min_count={min_count} times (got {len(text)} chars)")
        self.chars: list[str] = [self.UNKNOWN, *kept]
        self._ids = {char: index for index, char in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def __repr__(self) -> str:
        return f"CharacterVocabulary({len(self)} ids: unknown + {len(self) - 1} characters)"

    def encode(self, text: str) -> np.ndarray:
        """(N,) int32 ids of ``text``'s N characters; characters outside the vocabulary give 0."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return np.fromiter((self._ids.get(char, 0) for char in text), dtype=np.int32, count=len(text))

    def decode(self, ids) -> str:
        """The string of a 1-D sequence of ids (MLX or NumPy array, list); id 0 shows as :attr:`UNKNOWN`."""
        values = as_int_vector(ids, "ids")
        if values.ndim != 1:
            raise ValueError(f"ids: expected a 1-D sequence of ids, got shape {values.shape}")
        if values.size and (values.min() < 0 or values.max() >= len(self)):
            raise IndexError(
                f"ids: every id must lie in [0, {len(self)}); got values from {values.min()} to {values.max()}"
            )
        return "".join(self.chars[i] for i in values.tolist())


def tbptt_batches(ids, batch_size: int, length: int, offset: int = 0) -> list[tuple[mx.array, mx.array]]:
    """Windows for truncated backpropagation through time: a list of ``(inputs, targets)``, each (B, L) int32.

    The N ids (a 1-D MLX or NumPy integer array, or a list) less the first ``offset`` are cut into
    ``batch_size`` = B contiguous streams of S = (N - offset - 1) // B ids each; stream b is
    ``ids[offset + b*S : offset + (b+1)*S]`` and its targets are the same ids shifted by one.
    Window k holds steps ``[k*L, (k+1)*L)`` of every stream, so row b of window k + 1 continues
    row b of window k: a model may carry its state from one window to the next.  There are S // L
    windows; the ids that do not fill a last whole window are dropped.

    A new ``offset`` in ``[0, L)`` for each pass over the data (``rng.integers(length)``, as d2l
    does) moves every window boundary, so the same characters do not always start a window and
    the ids dropped at the end are not always the same ones.
    """
    check_positive_ints(batch_size=batch_size, length=length)
    check_nonnegative_ints(offset=offset)
    if offset >= length:
        raise ValueError(f"offset: expected an int in [0, length={length}), got {offset}")
    values = as_int_vector(ids, "ids")
    if values.ndim != 1:
        raise ValueError(f"ids: expected a 1-D sequence of ids, got shape {values.shape}")
    values = values[offset:]
    steps = (values.size - 1) // batch_size
    if steps < length:
        raise ValueError(
            f"ids: {values.size} ids after offset={offset} make streams of {steps} steps for "
            f"batch_size={batch_size}, fewer than one window of length={length}"
        )
    inputs = values[: batch_size * steps].reshape(batch_size, steps).astype(np.int32)  # (B, S)
    targets = values[1 : batch_size * steps + 1].reshape(batch_size, steps).astype(np.int32)  # (B, S)
    return [
        (mx.array(inputs[:, start : start + length]), mx.array(targets[:, start : start + length]))
        for start in range(0, steps // length * length, length)
    ]
