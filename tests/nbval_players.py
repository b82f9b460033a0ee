"""nbval plugin: what a reader sees online is what a kernel would show.

Each chapter page's controls switch between outputs computed when the book was built
(``seqlib.notebook.interact``, static).  nbval runs every chapter as Jupyter would, with live
widgets; with ``--players-site SITE`` this plugin adds one item after each chapter's last cell.
It renders a random sample of every player's settings in that same kernel with
``seqlib.notebook.render_setting`` and compares them with the outputs the built page stores:
printed text exactly, figures pixel by pixel.  The sample's seed is in every failure message
(``CONTROLS_SEED=...`` repeats it).

Checking in nbval's kernel, after nbval has run the chapter, costs no run of its own:
``make nbval`` loads the plugin (``-p tests.nbval_players``) where the built book matches its
sources, as in ``make test``, which builds the book first.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
from collections import defaultdict
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbval.plugin import IPyNbCell

SAMPLES = 2  # random settings per player, besides its default
SEED = int(os.environ.get("CONTROLS_SEED", random.randrange(10**6)))
PLAYER_DATA = re.compile(r'<script type="application/json" class="seqlib-interact-data">(.*?)</script>', re.S)
PART = re.compile(r'<pre>.*?</pre>|<img alt="figure" src="data:image/png;base64,([^"]*)">|<[^>]+>|[^<]+', re.S)

RECOMPUTE = """
import json as _json
from seqlib.notebook import render_setting as _render_setting
_asked = _json.loads({asked!r})
print(_json.dumps([_render_setting(globals()[name], setting) for name, setting in _asked]))
"""


def pytest_addoption(parser):
    parser.addoption(
        "--players-site", type=Path, default=None,
        help="the built site whose chapter pages' controls are recomputed in each chapter's kernel",
    )  # fmt: skip


def pytest_configure(config):
    site = config.getoption("players_site")
    if site is not None and not (site / "chapters").is_dir():
        raise pytest.UsageError(f"--players-site: expected a built site with a chapters/ folder, got {site}")


def pytest_collection_modifyitems(session, config, items):
    site = config.getoption("players_site")
    if site is None:
        return
    checked = []
    for i, item in enumerate(items):
        checked.append(item)
        last_cell = isinstance(item, IPyNbCell) and (i + 1 == len(items) or items[i + 1].parent is not item.parent)
        page = site / "chapters" / (Path(item.path).stem + ".html") if last_cell else None
        on_page = players(page) if page is not None else []
        if on_page:
            checked.append(
                PlayersMatchThePage.from_parent(
                    item.parent, name="players match the built page", cell_num=item.cell_num + 1,
                    cell=nbformat.v4.new_code_cell(""), options=defaultdict(bool, check=False),
                    page=page, on_page=on_page,
                )
            )  # fmt: skip
    items[:] = checked


def players(page: Path) -> list[dict]:
    return [json.loads(found) for found in PLAYER_DATA.findall(page.read_text())] if page.exists() else []


def sample(player: dict, rng: random.Random) -> list[int]:
    # indices into the player's settings: its default and SAMPLES others
    others = range(1, len(player["settings"]))
    return [0, *rng.sample(others, min(SAMPLES, len(others)))]


def pixels(encoded: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB"))


def differences(stored: str, live: str) -> str | None:
    """None when the two outputs show the same; else what differs."""
    if stored == live:
        return None
    stored_parts, live_parts = PART.findall(stored), PART.findall(live)
    if len(stored_parts) != len(live_parts):
        return f"{len(stored_parts)} parts stored, {len(live_parts)} live"
    for stored_match, live_match in zip(re.finditer(PART, stored), re.finditer(PART, live), strict=True):
        if stored_match.group(1) is not None and live_match.group(1) is not None:
            a, b = pixels(stored_match.group(1)), pixels(live_match.group(1))
            if a.shape != b.shape:
                return f"figure of {a.shape} stored, {b.shape} live"
            changed = np.mean(np.any(a != b, axis=-1))
            if changed > 0.002:  # anti-aliasing of a shifted edge, no more
                return f"{changed:.2%} of a figure's pixels differ"
        elif stored_match.group(0) != live_match.group(0):
            return f"stored {stored_match.group(0)[:200]!r}, live {live_match.group(0)[:200]!r}"
    return None


class PlayersMatchThePage(IPyNbCell):
    """Renders a sample of the page's player settings in the chapter's kernel, as nbval left it."""

    def __init__(self, *args, page: Path, on_page: list[dict], **kwargs):
        super().__init__(*args, **kwargs)
        self.page = page
        rng = random.Random(f"{SEED}:{page.name}")
        self.asked, self.stored = [], []
        for player in on_page:
            for j in sample(player, rng):
                setting = {
                    c["name"]: c["values"][k] for c, k in zip(player["controls"], player["settings"][j], strict=True)
                }
                self.asked.append((player["function"], setting))
                self.stored.append(player["outputs"][player["shows"][j]])
        self.cell.source = RECOMPUTE.format(asked=json.dumps(self.asked))

    def runtest(self):
        super().runtest()  # runs the cell in the kernel; raises on an error in it
        text = "".join(output.text for output in self.test_outputs if output.get("name") == "stdout")
        live = json.loads(text)
        problems = [
            f"{self.page.name}: {name}({setting}): {problem} (CONTROLS_SEED={SEED})"
            for (name, setting), a, b in zip(self.asked, self.stored, live, strict=True)
            if (problem := differences(a, b)) is not None
        ]
        if problems:
            self.raise_cell_error("the page's precomputed outputs differ from the live kernel's", "\n".join(problems))

    def reportinfo(self):
        return self.path, 0, f"{self.name} ({self.page.name})"


def pytest_report_header(config):
    site = config.getoption("players_site")
    if site is not None:
        return f"controls of {site} recomputed in each chapter's kernel, CONTROLS_SEED={SEED}"
