"""Every control of every chapter page, moved as a reader would, offline and with no kernel.

The chapters' controls are ``seqlib.notebook.interact`` players (see its docstring): in the
built site each one is plain HTML controls over outputs computed when the book was built.
For every control of every player this moves the control to each of its positions and checks
that the player then shows the precomputed setting that agrees with it (every control's
readout and position match that setting, the output shown is that setting's), and that the
output it drives changes somewhere along the way: a control that changes nothing is a bug.

It also weighs each chapter page: everything the browser fetches for it on a first visit
(the HTML, figures, scripts, stylesheets, fonts), against ``PAGE_BUDGET_MB``.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import open_page, site_pages, skip_or_fail_without_prerequisites, wait_for_math

pytestmark = pytest.mark.browser

CHAPTER_PAGES = site_pages("chapters")

#: What a chapter page may weigh on a first visit, shared assets (theme, MathJax, fonts) included.
PAGE_BUDGET_MB = 6.0

skip_or_fail_without_prerequisites()


def set_position(control, kind: str, labels: list[str], position: int) -> None:
    if kind == "select":
        control.select_option(index=position)
    elif kind == "checkbox":
        control.set_checked(labels[position] == "on")
    else:
        control.fill(str(position))  # a range input: Playwright sets the value and fires "input"


def shown_state(player) -> dict:
    state = player.evaluate(
        """root => ({
            setting: Number(root.dataset.setting),
            output: root.querySelector('.seqlib-interact-output').innerHTML,
            positions: [...root.querySelectorAll('.seqlib-interact-controls :is(input, select)')].map(
                c => c.type === 'checkbox' ? (c.checked ? 'on' : 'off') : Number(c.value)),
            readouts: [...root.querySelectorAll('.seqlib-interact-controls output')].map(o => o.textContent),
        })"""
    )
    # the theme makes scrollable <pre> blocks focusable (tabindex): not part of the output
    state["output"] = re.sub(r' tabindex="-?\d+"', "", state["output"])
    return state


def as_parsed(page, html: str) -> str:
    # the browser's own serialisation of a stored output, to compare with what the player shows
    return page.evaluate(
        "html => { const d = document.createElement('div'); d.innerHTML = html; return d.innerHTML; }", html
    )


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_every_control_drives_its_precomputed_output(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    players = page.locator("main .seqlib-interact")
    assert players.count() >= 1, f"{page_path}: no controls"
    for p in range(players.count()):
        player = players.nth(p)
        data = json.loads(player.locator(".seqlib-interact-data").text_content())
        expected = [as_parsed(page, html) for html in data["outputs"]]
        ranges = [m for m, c in enumerate(data["controls"]) if c["kind"] == "range"]  # controls with a readout
        start = shown_state(player)
        assert start["setting"] == 0 and start["output"] == expected[data["shows"][0]], f"{page_path}: not the default"
        for i, control in enumerate(data["controls"]):
            where = f"{page_path}, {data['function']}, control {control['name']!r}"
            element = player.locator(f'.seqlib-interact-controls [name="{control["name"]}"]')
            outputs_seen = set()
            for position in range(len(control["labels"])):
                set_position(element, control["kind"], control["labels"], position)
                state = shown_state(player)
                setting = data["settings"][state["setting"]]
                assert setting[i] == position, f"{where}: moved to {position}, shows setting {setting}"
                for m, other in enumerate(data["controls"]):  # every control shows the setting it selected
                    shows = state["positions"][m]
                    want = other["labels"][setting[m]] if other["kind"] == "checkbox" else setting[m]
                    assert shows == want, f"{where}: control {other['name']!r} shows {shows}, setting has {want}"
                assert state["readouts"] == [data["controls"][m]["labels"][setting[m]] for m in ranges], where
                assert state["output"] == expected[data["shows"][state["setting"]]], where
                outputs_seen.add(state["output"])
            assert len(outputs_seen) > 1, f"{where}: moving it never changes what the page shows"
            set_position(element, control["kind"], control["labels"], data["settings"][0][i])
    page.close()
    assert errors == [], f"{page_path}: console errors: {errors}"


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_chapter_page_weight_is_within_budget(browser, site_url, page_path):
    page, _ = open_page(browser, site_url, page_path)
    wait_for_math(page)  # MathJax fetches its fonts and extensions on first use
    page.wait_for_load_state("networkidle")
    loaded = page.evaluate(
        """() => [...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')]
                 .map(e => ({name: e.name, bytes: e.encodedBodySize}))"""
    )
    total = sum(entry["bytes"] for entry in loaded) / 1e6
    largest = sorted(loaded, key=lambda entry: -entry["bytes"])[:4]
    page.close()
    print(f"{page_path}: {total:.2f} MB in {len(loaded)} files")
    assert total <= PAGE_BUDGET_MB, f"{page_path}: {total:.2f} MB > {PAGE_BUDGET_MB} MB; largest: {largest}"
