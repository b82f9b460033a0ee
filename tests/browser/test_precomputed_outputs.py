"""What a reader sees online is what a kernel would show.

Each chapter page's controls switch between outputs computed when the book was built
(``seqlib.notebook.interact``).  This runs each chapter again in a kernel, as Jupyter would
(live widgets), then recomputes a random sample of every player's precomputed settings with
``seqlib.notebook.render_setting`` and compares them with the outputs stored in the page:
printed text exactly, figures pixel by pixel.  The sample's seed is in every failure message
(``CONTROLS_SEED=... make browser-test`` repeats it).
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import nbformat
import numpy as np
import pytest
from conftest import ROOT, SITE, site_pages, skip_or_fail_without_prerequisites

from seqlib.notebook import STATIC_CONTROLS_ENV

sys.path.insert(0, str(ROOT / "tools"))
from execute_chapters import run  # a chapter run with the book build's kernel client (issue 27)

pytestmark = pytest.mark.browser

CHAPTER_PAGES = site_pages("chapters")
SAMPLES = 2  # random settings per player, besides its default
SEED = int(os.environ.get("CONTROLS_SEED", random.randrange(10**6)))
PLAYER_DATA = re.compile(r'<script type="application/json" class="seqlib-interact-data">(.*?)</script>', re.S)
PART = re.compile(r'<pre>.*?</pre>|<img alt="figure" src="data:image/png;base64,([^"]*)">|<[^>]+>|[^<]+', re.S)

skip_or_fail_without_prerequisites()


def players(page_path: str) -> list[dict]:
    return [json.loads(found) for found in PLAYER_DATA.findall((SITE / page_path).read_text())]


def sample(player: dict, rng: random.Random) -> list[int]:
    # indices into the player's settings: its default and SAMPLES others
    others = range(1, len(player["settings"]))
    return [0, *rng.sample(others, min(SAMPLES, len(others)))]


RECOMPUTE = """
import json as _json
from seqlib.notebook import render_setting as _render_setting
_asked = _json.loads({asked!r})
print(_json.dumps([_render_setting(globals()[name], setting) for name, setting in _asked]))
"""


def recompute(page_path: str, asked: list[tuple[str, dict]]) -> list[str]:
    """Run the chapter in a live-widget kernel, then render the asked settings; their HTML, in order."""
    notebook_path = ROOT / page_path.replace(".html", ".ipynb")
    nb = nbformat.read(notebook_path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(RECOMPUTE.format(asked=json.dumps(asked))))
    run(nb, notebook_path.parent, env={**os.environ, STATIC_CONTROLS_ENV: "0"})  # where the book runs it
    text = "".join(output.text for output in nb.cells[-1].outputs if output.get("name") == "stdout")
    return json.loads(text)


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


def check(page_path: str) -> list[str]:
    rng = random.Random(f"{SEED}:{page_path}")
    asked, stored = [], []
    for player in players(page_path):
        for j in sample(player, rng):
            setting = {
                c["name"]: c["values"][k] for c, k in zip(player["controls"], player["settings"][j], strict=True)
            }
            asked.append((player["function"], setting))
            stored.append(player["outputs"][player["shows"][j]])
    live = recompute(page_path, asked)
    return [
        f"{page_path}: {name}({setting}): {problem} (CONTROLS_SEED={SEED})"
        for (name, setting), a, b in zip(asked, stored, live, strict=True)
        if (problem := differences(a, b)) is not None
    ]


def test_a_sample_of_every_players_outputs_matches_a_live_kernel():
    assert CHAPTER_PAGES, "no chapter pages"
    with ThreadPoolExecutor(max_workers=2) as pool:  # two kernels: this machine has two cores
        problems = [problem for found in pool.map(check, CHAPTER_PAGES) for problem in found]
    assert problems == [], "\n".join(problems)
