"""One look for every figure in the book.

Import on demand (``from seqlib import plotting``): it needs matplotlib, which
``import seqlib`` does not load.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt

__all__ = ["COLORS", "animation", "figure", "use_book_style"]

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


def animation(fig, draw_frame, frames: int, fps: float = 3):
    """A playable animation for the page: ``draw_frame(k)`` for k = 0 .. frames - 1, as jshtml.

    Returns an ``IPython.display.HTML`` object (show it as a cell's last value)
    and closes ``fig`` so the notebook does not also show its last frame.  Every
    frame is a PNG inside the page, so keep figures small (``dpi=72``) and
    frames few.  The animation plays once; its controls step and scrub it
    without a Python kernel.
    """
    from IPython.display import HTML
    from matplotlib.animation import FuncAnimation

    html = FuncAnimation(fig, draw_frame, frames=frames).to_jshtml(fps=fps, default_mode="once")
    plt.close(fig)
    return HTML(html)
