"""Helpers for the chapter notebooks (need IPython; import on demand).

``show_source`` is how every chapter shows the code it discusses: straight from
the installed library, so the page shows exactly what the tests test.

``show_kernel`` shows a Metal kernel as MLX compiles it: the body from
``metal_kernels/`` inside the signature MLX generates for it.

``interact`` is how every chapter offers a control: ``ipywidgets.interact`` in
Jupyter, and in the static book (no kernel) a player over outputs computed when
the book was built.

``below`` is how every chapter prints a comparison with a reference.  The digits
of a float32 rounding error depend on the machine (BLAS kernels, vector width,
thread count, Metal or CPU), so a chapter that printed ``4.47e-08`` would show
``0.0`` on the next CPU.  A bound is the claim the text makes, and it holds on
every machine; a broken computation still shows, because then the error itself
is printed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import inspect
import io
import itertools
import json
import math
import os
from pathlib import Path

import numpy as np
from IPython.display import Code

__all__ = [
    "MAX_FRAMES", "SLIDER_STOPS", "STATIC_CONTROLS_ENV", "below", "control_values", "interact", "render_setting",
    "show_kernel", "show_source", "static_controls", "static_player", "static_settings",
]  # fmt: skip


def show_source(obj) -> Code:
    """Syntax-highlighted source of a seqlib function, class or method."""
    return Code(inspect.getsource(obj), language="python")


def show_kernel(name: str, dtype=None, header: bool = True, **template) -> Code:
    """Syntax-highlighted source of seqlib's Metal kernel ``name`` with the signature MLX generates for it.

    ``dtype`` (default float32) and ``template`` values as :func:`seqlib.kernels.generated_source` takes them.
    ``header=False`` leaves out the shared header ``seqlib_math.h`` (the same for every kernel, so a
    chapter shows it once) and puts a one-line comment in its place.
    """
    import mlx.core as mx

    from seqlib.kernels import HEADER_NAME, generated_source, kernel_header

    text = generated_source(name, mx.float32 if dtype is None else dtype, **template)
    if not header:
        text = text.replace(kernel_header(), f"// ... {HEADER_NAME} (the shared helpers; shown once above) ...\n", 1)
    return Code(text, language="cpp")


def below(error, bound: float) -> str:
    """``"< 1e-06"`` when ``max |error|`` is below ``bound``, else the error itself, flagged.

    ``error`` is a number or an array of differences (MLX, NumPy or anything
    ``np.asarray`` takes); NaN counts as above every bound.

    >>> below(3e-8, 1e-6)
    '< 1e-06'
    >>> below([0.0, -2e-3], 1e-6)
    '= 2.0e-03, ABOVE the bound 1e-06'
    """
    worst = float(np.max(np.abs(np.asarray(error, dtype=np.float64)), initial=0.0))
    if worst < bound:
        return f"< {bound:.0e}"
    return f"= {worst:.1e}, ABOVE the bound {bound:.0e}"


# -- controls that work with and without a kernel ------------------------------------------------

#: Set (to anything but "" or "0") in the kernels that build the book (``book/_ext/book_kernels.py``):
#: :func:`interact` then shows a player over precomputed outputs instead of live widgets.
STATIC_CONTROLS_ENV = "SEQLIB_STATIC_CONTROLS"

#: How many values of a slider the static page offers where a chapter names none (the default among them).
SLIDER_STOPS = 9

#: The most settings :func:`interact` precomputes for one call (each one is a call of the function).
MAX_FRAMES = 80

_PLAYER_SCRIPT = Path(__file__).with_name("notebook_player.js")


def static_controls() -> bool:
    """True where :func:`interact` precomputes its outputs for a page with no kernel (the book build)."""
    return os.environ.get(STATIC_CONTROLS_ENV, "") not in ("", "0")


def interact(function, /, *, values: dict | None = None, combinations: list[dict] | None = None, **controls):
    """``ipywidgets.interact(function, **controls)`` in Jupyter; in the static book, the same controls precomputed.

    In a live kernel this is ``ipywidgets.interact``: every move of a control calls ``function``.
    Where :func:`static_controls` is on (the book build), ``function`` is called once for each
    setting of :func:`static_settings`, what it shows (figures, printed text) is captured, and the
    cell shows a player: HTML controls and a little JavaScript that switch between the captured
    outputs, with no kernel and no network.  On the page, moving a control selects the computed
    setting that agrees with it and with as many of the other controls as possible, and moves the
    others to match.

    Args:
        function: called as ``function(**setting)``; it shows its output (``plt.show()``, ``print``).
        values: ``{name: [value, ...]}``, the static values of a control (the default is added).
        combinations: extra settings to precompute, as partial ``{name: value}`` dicts.
        controls: ``name=widget`` as ``ipywidgets.interact`` takes them (sliders, ``Dropdown``, ``Checkbox``).
    """
    if not static_controls():
        import ipywidgets

        return ipywidgets.interact(function, **controls)
    from IPython.display import HTML, display

    display(HTML(static_player(function, controls, values=values, combinations=combinations)))
    return function


def control_values(name: str, widget, chosen=None) -> list[tuple[object, str]]:
    """The ``(value, label)`` pairs the static page offers for control ``name``, in the control's order.

    A dropdown offers its options, a checkbox both states, a slider at most ``SLIDER_STOPS``
    evenly spaced positions of its step grid from min to max (and max itself).  ``chosen`` names
    the values instead (each one the control can take); the control's default is always offered.
    """
    kind = _kind(name, widget)
    if kind == "range":
        return _slider_values(name, widget, chosen)
    if kind == "checkbox":
        grid = [(False, "off"), (True, "on")]
    else:
        grid = list(zip(widget._options_values, widget._options_labels, strict=True))
    if chosen is None:
        return grid
    offered = [value for value, _ in grid]
    unknown = [value for value in chosen if value not in offered]
    if unknown:
        raise ValueError(f"interact: values for {name!r} must be among {offered}, got {unknown}")
    return [(value, label) for value, label in grid if value in chosen or value == widget.value]


def _slider_values(name: str, widget, chosen) -> list[tuple[object, str]]:
    # a slider's positions k = 0 .. last stand for min + k * step (for a log slider, the exponent)
    logarithmic = hasattr(widget, "base")
    last = round((widget.max - widget.min) / widget.step)

    def position(value) -> int:
        coordinate = math.log(value, widget.base) if logarithmic else value
        k = round((coordinate - widget.min) / widget.step)
        on_grid = math.isclose(widget.min + k * widget.step, coordinate, abs_tol=1e-9 * widget.step)
        if not (0 <= k <= last and on_grid):
            raise ValueError(
                f"interact: value {value!r} for {name!r} is not a position of its slider "
                f"(min {widget.min}, max {widget.max}, step {widget.step})"
            )
        return k

    if chosen is None:  # every stride-th position, evenly spaced, and the maximum
        stride = max(1, math.ceil(last / (SLIDER_STOPS - 1)))
        positions = {*range(0, last + 1, stride), last}
    else:
        positions = {position(value) for value in chosen}
    values = {_slider_value(widget, widget.min + k * widget.step) for k in positions}
    values.add(widget.value)  # the default, even where it lies between two positions (as 0.5 on a log slider)
    return [(value, format(value, widget.readout_format)) for value in sorted(values)]


def _slider_value(widget, coordinate: float):
    value = widget.base**coordinate if hasattr(widget, "base") else coordinate
    return round(value) if isinstance(widget.value, int) else float(f"{value:.12g}")


def static_settings(controls: dict, values: dict | None = None, combinations: list[dict] | None = None) -> list[tuple]:
    """The settings :func:`interact` precomputes, as tuples of positions in each control's static values.

    The default setting comes first.  Every combination when there are at most ``MAX_FRAMES``;
    otherwise each control's values with the others at their defaults, then ``combinations``.
    """
    return _settings(controls, _grids(controls, values), combinations)


def _grids(controls: dict, values: dict | None) -> list[list[tuple[object, str]]]:
    # each control's (value, label) pairs, in the order of ``controls``
    values = values or {}
    unknown = sorted(set(values) - set(controls))
    if unknown:
        raise ValueError(f"interact: values for {unknown}, which are not controls ({sorted(controls)})")
    return [control_values(name, control, values.get(name)) for name, control in controls.items()]


def _settings(controls: dict, labelled: list[list[tuple[object, str]]], combinations: list[dict] | None) -> list[tuple]:
    grids = [[value for value, _ in grid] for grid in labelled]
    default = tuple(grid.index(widget.value) for grid, widget in zip(grids, controls.values(), strict=True))
    if math.prod(len(grid) for grid in grids) <= MAX_FRAMES:
        settings = list(itertools.product(*(range(len(grid)) for grid in grids)))
    else:
        settings = [(*default[:i], k, *default[i + 1 :]) for i, grid in enumerate(grids) for k in range(len(grid))]
    for extra in combinations or []:
        names = sorted(set(extra) - set(controls))
        if names:
            raise ValueError(f"interact: combination {extra} names {names}, which are not controls")
        setting = list(default)
        for i, name in enumerate(controls):
            if name in extra:
                if extra[name] not in grids[i]:
                    raise ValueError(f"interact: combination value {name}={extra[name]!r} is not among {grids[i]}")
                setting[i] = grids[i].index(extra[name])
        settings.append(tuple(setting))
    settings = [default] + [setting for setting in dict.fromkeys(settings) if setting != default]
    if len(settings) > MAX_FRAMES:
        raise ValueError(f"interact: {len(settings)} settings to precompute, more than MAX_FRAMES = {MAX_FRAMES}")
    return settings


class _Recorder:
    """What a call shows, in order: printed text and display outputs (figures) as HTML.

    It stands in for the shell's display publisher, whose ``is_publishing`` IPython's stderr tee
    reads on every write: a warning inside the call goes to the cell's stderr as usual (where the
    book build fails on it), not into the player.
    """

    is_publishing = False

    def __init__(self):
        self.parts: list[str] = []
        self.text = io.StringIO()

    def write(self, text: str) -> int:  # sys.stdout while recording
        self.text.write(text)
        return len(text)

    def flush(self) -> None:
        pass

    def end_text(self) -> None:
        if self.text.getvalue():
            self.parts.append(f"<pre>{html.escape(self.text.getvalue())}</pre>")
            self.text = io.StringIO()

    def publish(self, data, metadata=None, *args, **kwargs) -> None:  # the shell's display publisher
        self.end_text()
        if "image/png" in data:
            self.parts.append(f'<img alt="figure" src="data:image/png;base64,{_small_png(data["image/png"])}">')
        elif "image/svg+xml" in data:
            self.parts.append(data["image/svg+xml"])
        elif "text/html" in data:
            self.parts.append(data["text/html"])
        else:
            self.parts.append(f"<pre>{html.escape(data.get('text/plain', ''))}</pre>")

    def clear_output(self, wait=False) -> None:
        self.parts.clear()


def _small_png(encoded: str) -> str:
    # The same figure in a palette of at most 256 colours: about a third of the bytes, no visible change.
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB")
    buffer = io.BytesIO()
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(buffer, "png", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def render_setting(function, setting: dict) -> str:
    """What ``function(**setting)`` shows, as the HTML the static player stores for it.

    Printed text becomes ``<pre>`` blocks, figures shown with ``plt.show()`` palette PNGs, in the
    order they were shown; figures the call leaves open are closed, not shown.
    """
    import matplotlib.pyplot as plt
    from IPython import get_ipython

    shell = get_ipython()
    recorder = _Recorder()
    open_before = set(plt.get_fignums())
    publisher = shell.display_pub if shell is not None else None
    try:
        if publisher is not None:
            shell.display_pub = recorder
        with contextlib.redirect_stdout(recorder):
            function(**setting)
    finally:
        if publisher is not None:
            shell.display_pub = publisher
        for number in set(plt.get_fignums()) - open_before:
            plt.close(number)
    recorder.end_text()
    return "\n".join(recorder.parts)


def static_player(function, controls: dict, values: dict | None = None, combinations: list[dict] | None = None) -> str:
    """The HTML of :func:`interact`'s kernel-free player: controls, precomputed outputs, the script that switches."""
    names = list(controls)
    grids = _grids(controls, values)
    settings = _settings(controls, grids, combinations)
    outputs: dict[str, int] = {}  # distinct output -> its index; settings that show the same share it
    shown = []
    for setting in settings:
        chosen = {name: grid[k][0] for name, grid, k in zip(names, grids, setting, strict=True)}
        output = render_setting(function, chosen)
        shown.append(outputs.setdefault(output, len(outputs)))
    data = {
        "function": getattr(function, "__name__", ""),
        "controls": [
            {"name": name, "description": _description(name, controls[name]), "kind": _kind(name, controls[name]),
             "values": [value for value, _ in grid], "labels": [label for _, label in grid]}
            for name, grid in zip(names, grids, strict=True)
        ],
        "settings": [list(setting) for setting in settings],
        "shows": shown,
        "outputs": list(outputs),
        "complete": len(settings) == math.prod(len(grid) for grid in grids),
    }  # fmt: skip
    payload = json.dumps(data, separators=(",", ":"), default=repr).replace("</", "<\\/")
    digest = hashlib.sha1(payload.encode()).hexdigest()[:10]
    return (
        f'<div class="seqlib-interact" id="seqlib-interact-{digest}">'
        f'<script type="application/json" class="seqlib-interact-data">{payload}</script>'
        f"<script>{_PLAYER_SCRIPT.read_text()}</script></div>"
    )


def _kind(name: str, widget) -> str:
    """How the player draws control ``name``: "range" (a slider), "select" or "checkbox"."""
    import ipywidgets

    if isinstance(widget, ipywidgets.Checkbox | ipywidgets.ToggleButton):
        return "checkbox"
    if isinstance(widget, ipywidgets.widgets.widget_selection._Selection):
        return "select"
    if isinstance(widget, ipywidgets.IntSlider | ipywidgets.FloatSlider | ipywidgets.FloatLogSlider):
        return "range"
    raise TypeError(
        f"interact: control {name!r} must be a slider, Dropdown, Checkbox or ToggleButton, got {type(widget).__name__}"
    )


def _description(name: str, widget) -> str:
    return getattr(widget, "description", "") or name
