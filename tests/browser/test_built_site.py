"""The built book, opened in headless Chromium as a reader would open it.

Needs the site in _build/html (``make book``) and Debian's Chromium; run with
``make browser-test`` (``make test`` runs it too).  The browser gets no
internet: every request that leaves 127.0.0.1 is aborted, so the pages must
work offline, and console errors from our own pages fail the test.  The
fixtures and page loading are in ``conftest.py`` beside this file.
"""

from __future__ import annotations

import pytest
from conftest import SCREENSHOTS, open_page, site_pages, skip_or_fail_without_prerequisites, wait_for_math

pytestmark = pytest.mark.browser

CONTENT_PAGES = site_pages("book", "chapters")
CHAPTER_PAGES = [page for page in CONTENT_PAGES if page.startswith("chapters/")]

skip_or_fail_without_prerequisites()


@pytest.mark.parametrize("page_path", ["index.html", *CONTENT_PAGES])
def test_page_loads_offline_with_all_images_and_no_console_errors(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    broken = page.evaluate(
        "[...document.querySelectorAll('main img')].filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => i.src.slice(0, 80))"
    )
    assert broken == [], f"{page_path}: images that did not load: {broken}"
    assert page.locator("main h1").count() >= 1, f"{page_path}: no title"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / (page_path.replace("/", "_") + ".png")))
    page.close()
    # Filter known noise only by exact text, so anything new still fails.
    assert errors == [], f"{page_path}: console errors: {errors}"


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_chapter_shows_figures_controls_and_a_playable_animation(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    figures = page.evaluate(
        "[...document.querySelectorAll('main .cell_output img')].filter(i => i.naturalWidth > 0).length"
    )
    assert figures >= 1, f"{page_path}: no rendered matplotlib figure"

    # seqlib.notebook.interact's players draw their controls (test_controls.py moves them)
    controls = page.evaluate("document.querySelectorAll('main .seqlib-interact-controls :is(input, select)').length")
    assert controls >= 1, f"{page_path}: no controls"

    # matplotlib's jshtml animation: stepping the slider changes the frame shown.
    frame = page.locator("main .animation img").first
    first_src = frame.get_attribute("src")
    page.locator("main .animation .anim-slider").first.fill("5")
    page.locator("main .animation .anim-slider").first.dispatch_event("input")
    assert frame.get_attribute("src") != first_src, f"{page_path}: the animation does not step"
    page.close()
    assert errors == [], f"{page_path}: console errors: {errors}"


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_chapter_math_is_typeset_offline_with_fonts_from_the_site(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    started = wait_for_math(page)
    math = page.evaluate(
        """() => {
            const spans = [...document.querySelectorAll('main .math')];
            const untypeset = spans.filter(s => !s.querySelector('mjx-container'));
            // the text of a math element outside MathJax's output: what a reader would see as raw TeX
            const leftover = spans.map(s => {
                const copy = s.cloneNode(true);
                copy.querySelectorAll('mjx-container, .eqno').forEach(c => c.remove());  // .eqno: "(1)#"
                return copy.textContent.trim();
            }).filter(text => text !== '');
            const fonts = [...document.fonts].filter(f => f.family.startsWith('MJX'));
            return {
                spans: spans.length,
                typeset: document.querySelectorAll('main mjx-container').length,
                untypeset: untypeset.map(s => s.textContent.slice(0, 60)),
                leftover: leftover.map(t => t.slice(0, 60)),
                errors: [...document.querySelectorAll('main mjx-merror')].map(e => e.textContent.slice(0, 60)),
                fonts_loaded: fonts.filter(f => f.status === 'loaded').map(f => f.family),
                fonts_failed: fonts.filter(f => f.status === 'error').map(f => f.family),
                mathjax: [...document.scripts].map(s => s.src).filter(src => src.includes('mathjax')),
            };
        }"""
    )
    page.close()
    assert started, f"{page_path}: MathJax never started (scripts: {math['mathjax']}; console: {errors})"
    assert math["mathjax"] and all(src.startswith(site_url) for src in math["mathjax"]), (
        f"{page_path}: MathJax is not served by the site: {math['mathjax']}"
    )
    assert math["spans"] >= 1 and math["typeset"] >= math["spans"], f"{page_path}: {math}"
    assert math["untypeset"] == [], f"{page_path}: formulas left as TeX: {math['untypeset'][:5]}"
    assert math["leftover"] == [], f"{page_path}: raw TeX next to typeset math: {math['leftover'][:5]}"
    assert math["errors"] == [], f"{page_path}: MathJax errors: {math['errors'][:5]}"
    assert math["fonts_loaded"] and math["fonts_failed"] == [], (
        f"{page_path}: MathJax fonts loaded {math['fonts_loaded']}, failed {math['fonts_failed']}"
    )
    assert errors == [], f"{page_path}: console errors: {errors}"


@pytest.mark.parametrize("page_path", CHAPTER_PAGES)
def test_chapter_has_launch_buttons_for_its_own_notebook(page_path):
    # Binder and Colab open the chapter's notebook from the repository in _config.yml
    # (its first cell then installs what is missing: tools/install_cell.py)
    import sys

    from conftest import ROOT, SITE

    sys.path.insert(0, str(ROOT / "tools"))
    from install_cell import repository_url  # where _config.yml's address is read, for the install cells too

    repository = repository_url().removeprefix("https://github.com/")
    assert "/" in repository and "://" not in repository, f"not a GitHub repository: {repository_url()}"
    notebook = page_path.replace(".html", ".ipynb")
    html = (SITE / page_path).read_text()
    assert f'href="https://mybinder.org/v2/gh/{repository}/main?urlpath=lab/tree/{notebook}"' in html
    assert f'href="https://colab.research.google.com/github/{repository}/blob/main/{notebook}"' in html
