"""Re-execute chapters in place, with the kernel client the book build uses.

    python tools/execute_chapters.py chapters/13_character_language_model.ipynb [...]

``jupyter nbconvert --execute`` uses jupyter_client's own kernel client, which can lose a cell's
reply when the cell has live widgets (jupyter/nbclient#312, issue 27): on a chapter with an
``interact`` it may then wait until its cell timeout, or forever without one. This runs each
notebook from its own folder, as the book build and nbval do, with ``book/_ext/book_kernels.py``'s
client, and writes it back with its new outputs (controls stay live widgets: no
``SEQLIB_STATIC_CONTROLS``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from book_kernels import configure_kernel_manager  # noqa: E402


def run(notebook, folder: Path, timeout: int = 600, **kernel) -> None:
    """Execute ``notebook`` (an nbformat node, outputs filled in place) from ``folder``, with the book's client.

    ``kernel`` goes to the kernel's start (``env=...``)."""
    configure_kernel_manager()
    resources = {"metadata": {"path": str(folder)}}
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources=resources).execute(**kernel)


def execute(path: Path, timeout: int = 600) -> float:
    """Re-execute the notebook at ``path`` from its folder and write it back; the seconds it took."""
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    run(notebook, path.parent, timeout)
    nbformat.write(notebook, path)
    return time.perf_counter() - start


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    for name in paths:
        print(f"{name}: executed in {execute(Path(name).resolve()):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
