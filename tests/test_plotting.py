"""seqlib.plotting: the book's figure style and its jshtml animations."""

import re

import matplotlib
import matplotlib.pyplot as plt

from seqlib import plotting


def test_animation_draws_every_frame_into_a_closed_figure():
    fig, axis = plotting.figure(figsize=(2, 2), dpi=30)
    drawn = []

    def draw(step):
        drawn.append(step)
        axis.clear()
        axis.plot([0, step], [0, step])

    html = plotting.animation(fig, draw, frames=4, fps=2).data
    assert sorted(set(drawn)) == [0, 1, 2, 3]
    assert len(re.findall(r"data:image/png;base64", html)) == 4
    assert "anim-slider" in html and not plt.fignum_exists(fig.number)


def test_figure_applies_the_book_style():
    fig, axes = plotting.figure(1, 2)
    assert len(axes) == 2 and matplotlib.rcParams["axes.spines.top"] is False
    assert fig.get_layout_engine() is not None
    plt.close(fig)
