"""Where seqlib's Metal kernel sources live, and how to read them.

The kernels are plain ``.metal`` files: the *bodies* that
``mx.fast.metal_kernel`` wraps in a generated signature.  In a source checkout
they sit in the top-level ``metal_kernels/`` folder, next to the chapters that
discuss them; an installed wheel ships the same files as package data in
``seqlib/metal_kernels/``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["kernel_dir", "kernel_names", "kernel_source"]

_PACKAGE_DIR = Path(__file__).resolve().parent
_CANDIDATES = (
    _PACKAGE_DIR / "metal_kernels",  # installed wheel (package data)
    _PACKAGE_DIR.parent / "metal_kernels",  # source checkout / editable install
)


def kernel_dir() -> Path:
    """The folder holding the ``.metal`` sources."""
    for folder in _CANDIDATES:
        if any(folder.glob("*.metal")):
            return folder
    searched = ", ".join(str(folder) for folder in _CANDIDATES)
    raise FileNotFoundError(f"seqlib's Metal kernel sources were not found (looked in {searched})")


def kernel_names() -> list[str]:
    """The names of all available kernels (file names without ``.metal``)."""
    return sorted(path.stem for path in kernel_dir().glob("*.metal"))


def kernel_source(name: str) -> str:
    """The text of ``metal_kernels/<name>.metal``."""
    names = kernel_names()
    if name not in names:
        raise ValueError(f"name: no Metal kernel called {name!r}; available: {', '.join(names)}")
    return (kernel_dir() / f"{name}.metal").read_text()
