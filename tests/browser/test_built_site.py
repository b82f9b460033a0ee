"""The built book, opened in headless Chromium as a reader would open it.

Needs the site in _build/html (``make book``) and Debian's Chromium; run with
``make browser-test`` (``make test`` runs it too).  The browser gets no
internet: every request that leaves 127.0.0.1 is aborted, so the pages must
work offline, and console errors from our own pages fail the test.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
CONTENT_PAGES = sorted(
    path.relative_to(SITE).as_posix()
    for folder in ("book", "chapters")
    for path in (SITE / folder).glob("*.html")
) if SITE.exists() else []  # fmt: skip
CHAPTER_PAGES = [page for page in CONTENT_PAGES if page.startswith("chapters/")]

if not SITE.exists() or CHROMIUM is None:
    missing = "the built site (run `make book`)" if not SITE.exists() else "Chromium (apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"the browser test needs {missing}", pytrace=False)
    pytest.skip(f"needs {missing}", allow_module_level=True)


@pytest.fixture(scope="module")
def site_url():
    handler = functools.partial(QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def open_page(browser, site_url: str, page_path: str):
    """Load a page offline; return it with the console errors raised by our own files."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []

    def is_ours(url: str) -> bool:
        return url.startswith(site_url) or url == ""

    page.route("**/*", lambda route: route.continue_() if is_ours(route.request.url) else route.abort())
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and is_ours(m.location["url"]) else None)
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda r: errors.append(f"failed: {r.url}") if is_ours(r.url) else None)
    response = page.goto(f"{site_url}/{page_path}", wait_until="load")
    assert response is not None and response.ok, f"{page_path}: HTTP {response and response.status}"
    # index.html is a meta-refresh to book/intro.html: wait for the page it lands on, not a fixed delay
    # (300 ms was not always enough for the first page of a fresh browser on a loaded 2-core machine).
    page.wait_for_selector("main", state="attached", timeout=20_000)
    page.wait_for_load_state("load")
    page.wait_for_timeout(300)
    return page, errors


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
def test_chapter_shows_figures_widgets_and_a_playable_animation(browser, site_url, page_path):
    page, errors = open_page(browser, site_url, page_path)
    figures = page.evaluate(
        "[...document.querySelectorAll('main .cell_output img')].filter(i => i.naturalWidth > 0).length"
    )
    assert figures >= 1, f"{page_path}: no rendered matplotlib figure"

    # The widget manager replaces each saved widget view with live controls.
    page.wait_for_selector("main .jupyter-widgets.widget-slider, main .jupyter-widgets input", timeout=15000)
    controls = page.evaluate("document.querySelectorAll('main .jupyter-widgets').length")
    assert controls >= 1, f"{page_path}: the widget area is empty"

    # matplotlib's jshtml animation: stepping the slider changes the frame shown.
    frame = page.locator("main .animation img").first
    first_src = frame.get_attribute("src")
    page.locator("main .animation .anim-slider").first.fill("5")
    page.locator("main .animation .anim-slider").first.dispatch_event("input")
    assert frame.get_attribute("src") != first_src, f"{page_path}: the animation does not step"
    page.close()
    assert errors == [], f"{page_path}: console errors: {errors}"
