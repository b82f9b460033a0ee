"""seqlib.notebook.interact: live widgets in Jupyter, a kernel-free player over precomputed outputs in the book."""

from __future__ import annotations

import json
import re

import ipywidgets as widgets
import nbformat
import pytest
from nbclient import NotebookClient

from seqlib import notebook
from seqlib.notebook import MAX_FRAMES, STATIC_CONTROLS_ENV, control_values, static_settings


def test_dropdowns_checkboxes_and_sliders_offer_their_values():
    assert control_values("d", widgets.Dropdown(options=["1", "2", "inf"], value="2")) == [
        ("1", "1"), ("2", "2"), ("inf", "inf")]  # fmt: skip
    assert control_values("pairs", widgets.Dropdown(options=[("one", 1), ("two", 2)], value=2)) == [
        (1, "one"), (2, "two")]  # fmt: skip
    assert control_values("c", widgets.Checkbox(value=True)) == [(False, "off"), (True, "on")]
    # 13 positions (0, 0.25, ..., 3): every second one, evenly spaced, the default 1.0 among them
    slider = widgets.FloatSlider(value=1.0, min=0.0, max=3.0, step=0.25)
    assert [value for value, _ in control_values("s", slider)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    # a default off the stride is added; the maximum is always offered
    odd = widgets.IntSlider(value=7, min=1, max=40)
    values = [value for value, _ in control_values("i", odd)]
    assert values[0] == 1 and values[-1] == 40 and 7 in values and len(values) <= notebook.SLIDER_STOPS + 1
    assert all(isinstance(value, int) for value in values)
    log = widgets.FloatLogSlider(value=100, base=10, min=0, max=4, step=1)
    assert control_values("l", log) == [(1.0, "1"), (10.0, "10"), (100.0, "100"), (1000.0, "1e+03"), (10000.0, "1e+04")]


def test_chosen_values_must_be_positions_of_the_control():
    slider = widgets.FloatSlider(value=4.0, min=-2.0, max=8.0, step=0.5)
    assert [value for value, _ in control_values("f", slider, [7.0, -2.0])] == [-2.0, 4.0, 7.0]
    with pytest.raises(ValueError, match=r"value 7.25 for 'f' is not a position of its slider"):
        control_values("f", slider, [7.25])
    with pytest.raises(ValueError, match=r"value 9.0 for 'f'"):
        control_values("f", slider, [9.0])
    with pytest.raises(ValueError, match=r"values for 'd' must be among \['a', 'b'\], got \['c'\]"):
        control_values("d", widgets.Dropdown(options=["a", "b"], value="a"), ["c"])
    with pytest.raises(TypeError, match=r"control 't' must be a slider, Dropdown, Checkbox or ToggleButton, got Text"):
        control_values("t", widgets.Text())


def test_small_grids_are_complete_large_ones_vary_one_control_at_a_time():
    small = {"a": widgets.IntSlider(value=2, min=1, max=4), "b": widgets.Checkbox(value=False)}
    settings = static_settings(small)
    assert settings[0] == (1, 0)  # the default first: a = 2 is position 1
    assert sorted(settings) == [(a, b) for a in range(4) for b in range(2)]

    large = {name: widgets.IntSlider(value=5, min=1, max=9) for name in "abc"}  # 9 ** 3 > MAX_FRAMES
    settings = static_settings(large)
    assert 9**3 > MAX_FRAMES and len(settings) == 1 + 3 * 8
    assert all(sum(k != 4 for k in setting) <= 1 for setting in settings)  # at most one off its default
    extra = static_settings(large, combinations=[{"a": 1, "b": 9}])
    assert extra[-1] == (0, 8, 4) and len(extra) == len(settings) + 1


def test_bad_settings_name_what_is_wrong():
    controls = {"a": widgets.IntSlider(value=2, min=1, max=4)}
    with pytest.raises(ValueError, match=r"values for \['b'\], which are not controls \(\['a'\]\)"):
        static_settings(controls, values={"b": [1]})
    with pytest.raises(ValueError, match=r"combination \{'z': 1\} names \['z'\]"):
        static_settings(controls, combinations=[{"z": 1}])
    with pytest.raises(ValueError, match=r"combination value a=3 is not among \[1, 2, 4\]"):
        static_settings(controls, values={"a": [1, 4]}, combinations=[{"a": 3}])
    many = {name: widgets.IntSlider(value=1, min=1, max=60) for name in "ab"}
    with pytest.raises(ValueError, match=r"more than MAX_FRAMES"):
        static_settings(many, values={"a": list(range(1, 61)), "b": list(range(1, 61))})


CELL = """
import sys

import matplotlib.pyplot as plt
import ipywidgets as widgets
from seqlib import plotting
from seqlib.notebook import interact

def show(scale=1.0, label="x", flag=True):
    print("first", scale)
    print("a note on stderr", file=sys.stderr)  # as a warning would: the cell's stderr, not the player
    _, axis = plotting.figure(figsize=(2, 1.5))
    axis.plot([0, 1], [0, scale])
    plt.show()
    plt.figure()  # left open, never shown: closed, not captured
    print("then", label, flag)

interact(show, values={"scale": [0.5, 1.0, 2.0]},
         scale=widgets.FloatSlider(value=1.0, min=0.5, max=2.0, step=0.5, description="scale"),
         label=widgets.Dropdown(options=["x", "y"], value="x"), flag=widgets.Checkbox(value=True));
"""


def run_cell(monkeypatch, static: bool) -> list[dict]:
    monkeypatch.setenv(STATIC_CONTROLS_ENV, "1" if static else "0")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    return nb.cells[0].outputs


def player_data(html: str) -> dict:
    return json.loads(re.search(r'class="seqlib-interact-data">(.*?)</script>', html, re.S).group(1))


@pytest.mark.slow
def test_in_the_book_build_the_cell_shows_a_player_over_every_setting(monkeypatch):
    outputs = run_cell(monkeypatch, static=True)
    (output,) = [o for o in outputs if o.output_type == "display_data"]
    assert "application/vnd.jupyter.widget-view+json" not in output.data
    assert any(o.output_type == "stream" and o.name == "stderr" and "a note on stderr" in o.text for o in outputs)
    html = output.data["text/html"]
    assert "<script>" in html and "(function ()" in html  # the player script, inline
    data = player_data(html)
    assert [c["kind"] for c in data["controls"]] == ["range", "select", "checkbox"]
    assert data["controls"][0]["labels"] == ["0.50", "1.00", "2.00"]
    assert data["complete"] and len(data["settings"]) == 3 * 2 * 2 and data["settings"][0] == [1, 0, 1]
    # each setting shows its own output: printed text and the one shown figure, in order
    assert len(data["outputs"]) == 12
    first = data["outputs"][data["shows"][0]]
    parts = re.findall(r"<pre>.*?</pre>|<img [^>]*>", first, re.S)
    assert parts[0] == "<pre>first 1.0\n</pre>" and parts[1].startswith('<img alt="figure" src="data:image/png;base64,')
    assert parts[2] == "<pre>then x True\n</pre>" and len(parts) == 3


@pytest.mark.slow
def test_in_jupyter_the_cell_is_a_live_interact(monkeypatch):
    outputs = run_cell(monkeypatch, static=False)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert not any("seqlib-interact" in str(o.get("data", {}).get("text/html", "")) for o in outputs)


def test_a_default_between_two_slider_positions_is_offered_as_it_is():
    # 0.5 on a log slider of step 0.1 is 10 ** -0.30103: no position, but the value a reader starts from
    log = widgets.FloatLogSlider(value=0.5, base=10, min=-1, max=3)
    values = [value for value, _ in control_values("m", log, [0.1, 1.0, 10.0])]
    assert values == [0.1, 0.5, 1.0, 10.0]
    assert static_settings({"m": log}, values={"m": [0.1, 1.0, 10.0]})[0] == (1,)
