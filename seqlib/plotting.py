"""One look for every figure in the book.

Import on demand (``from seqlib import plotting``): it needs matplotlib, which
``import seqlib`` does not load.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = ["COLORS", "figure", "use_book_style"]

# Colour roles used across chapters, so the same idea keeps the same colour.
COLORS = {
    "input": "#4C72B0",
    "hidden": "#DD8452",
    "cell": "#55A868",
    "gate": "#C44E52",
    "reference": "#8172B3",
    "muted": "#8C8C8C",
}

_BOOK_STYLE = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.prop_cycle": mpl.cycler(color=list(COLORS.values())),
    "animation.embed_limit": 8.0,  # MB, enough for the book's short animations
    "svg.hashsalt": "seqlib",  # stable ids in SVG output
}


def use_book_style() -> None:
    """Apply the book's matplotlib defaults to every later figure."""
    mpl.rcParams.update(_BOOK_STYLE)


def figure(nrows: int = 1, ncols: int = 1, **kwargs):
    """``plt.subplots`` with the book's style applied; returns ``(fig, axes)``."""
    use_book_style()
    return plt.subplots(nrows, ncols, layout="constrained", **kwargs)
