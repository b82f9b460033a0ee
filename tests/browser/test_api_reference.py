"""The API reference in the built book: its pages, an entry with its signature and typeset math, and
the chapters' links into it (``{py:class}`seqlib.nn.LSTM``` and friends), followed in Chromium.

Needs the built site and Chromium like ``test_built_site.py``, whose fixtures (``conftest.py``
beside this file) it uses.  ``tests/test_docstrings.py`` checks the same links without a build:
that each names an object the reference documents.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from conftest import ROOT, SITE, open_page, site_pages, skip_or_fail_without_prerequisites, wait_for_math

pytestmark = pytest.mark.browser

skip_or_fail_without_prerequisites()

API_PAGES = site_pages("book/api")
CHAPTER_PAGES = site_pages("chapters")
API_LINK = re.compile(r'href="((?:\.\./)?book/api/[\w.]+\.html)#([\w.]+)"')


def roles_in_chapter_sources() -> int:
    """How many {py:...} roles the chapters' Markdown cells use."""
    count = 0
    for notebook in (ROOT / "chapters").glob("*.ipynb"):
        cells = json.loads(notebook.read_text())["cells"]
        text = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
        count += len(re.findall(r"\{py:\w+\}`", text))
    return count


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.ids.update(value for name, value in attrs if name == "id" and value)


def ids_in(page: str) -> set[str]:
    parser = _Ids()
    parser.feed((SITE / page).read_text())
    return parser.ids


def chapter_links() -> dict[str, list[tuple[str, str]]]:
    """For each chapter page, its links into the API reference as (page, anchor)."""
    links = {}
    for chapter in CHAPTER_PAGES:
        found = API_LINK.findall((SITE / chapter).read_text())
        if found:
            links[chapter] = [(href.removeprefix("../"), anchor) for href, anchor in found]
    return links


def test_every_reference_page_is_built():
    expected = {f"book/api/{path.stem}.html" for path in (ROOT / "book" / "api").glob("*.md")}
    assert len(expected) >= 15 and expected <= set(API_PAGES), f"not built: {sorted(expected - set(API_PAGES))}"


@pytest.mark.parametrize("page_path", API_PAGES)
def test_reference_page_loads_offline_with_entries_and_no_console_errors(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    entries = page.locator("main dl.py > dt.sig-object").count()
    title = page.locator("main h1").first.inner_text()
    page.close()
    assert "seqlib" in title or page_path.endswith("index.html"), f"{page_path}: title {title!r}"
    assert entries >= 1 or page_path.endswith("index.html"), f"{page_path}: no autodoc entries"
    assert errors == [], f"{page_path}: console errors: {errors}"


def test_lstm_entry_shows_its_signature_and_typeset_math(browser, site_url):
    page, errors = open_page(browser, site_url, "book/api/nn.html")
    assert wait_for_math(page), "MathJax never started on the nn page"
    entry = page.evaluate(
        """() => {
            const dt = document.getElementById('seqlib.nn.LSTM');
            if (!dt) return null;
            const dd = dt.nextElementSibling;
            return {signature: dt.innerText, text: dd.innerText,
                    typeset: dd.querySelectorAll('mjx-container').length,
                    raw: dd.innerText.includes('\\\\begin{aligned}') || dd.innerText.includes('\\\\sigma')};
        }"""
    )
    page.close()
    assert entry is not None, "book/api/nn.html has no entry seqlib.nn.LSTM"
    for argument in ("input_size", "hidden_size", "num_layers", "batch_first", "bidirectional", "proj_size"):
        assert argument in entry["signature"], f"LSTM's signature lacks {argument}: {entry['signature']!r}"
    for section in ("Parameters", "Inputs", "Outputs", "Weights", "weight_ih_l{k}", "(T, B, D)"):
        assert section in entry["text"], f"LSTM's entry lacks {section!r}"
    assert entry["typeset"] >= 5 and not entry["raw"], f"LSTM's math is not typeset: {entry['typeset']} formulas"
    assert errors == [], f"console errors: {errors}"


def test_chapter_links_resolve_to_reference_entries():
    """Every role became a link (an unresolved role renders as bare code) whose anchor exists."""
    if roles_in_chapter_sources() == 0:
        pytest.skip("no chapter uses a {py:...} role yet")
    links = chapter_links()
    assert links, "the chapters use {py:...} roles, but no built chapter links into book/api/"
    unresolved = {}
    for chapter in CHAPTER_PAGES:
        html = (SITE / chapter).read_text()
        roles, linked = html.count('<code class="xref py'), len(re.findall(r'<a [^>]*>\s*<code class="xref py', html))
        if roles != linked:
            unresolved[chapter] = roles - linked
    assert unresolved == {}, f"roles that link nowhere (chapter: how many): {unresolved}"
    anchors = {page: ids_in(page) for page in API_PAGES}
    missing = [(chapter, page, anchor) for chapter, found in links.items() for page, anchor in found
               if anchor not in anchors.get(page, set())]  # fmt: skip
    assert missing == [], f"links to anchors that do not exist: {missing[:5]}"


def test_a_chapter_link_to_lstm_leads_to_its_entry(browser, site_url):
    links = chapter_links()
    chapters = [chapter for chapter, found in links.items() if ("book/api/nn.html", "seqlib.nn.LSTM") in found]
    if not chapters:
        pytest.skip("no chapter links seqlib.nn.LSTM yet")
    page, errors = open_page(browser, site_url, chapters[0])
    page.locator('main a[href$="book/api/nn.html#seqlib.nn.LSTM"]').first.click()
    page.wait_for_url("**/book/api/nn.html#seqlib.nn.LSTM", timeout=20_000)
    target = page.locator('[id="seqlib.nn.LSTM"]')
    assert target.count() == 1 and target.is_visible()
    assert "Long short-term memory" in page.locator('[id="seqlib.nn.LSTM"] + dd').inner_text()
    page.close()
    assert errors == [], f"{chapters[0]}: console errors: {errors}"
