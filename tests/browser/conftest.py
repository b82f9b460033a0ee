"""What the browser checks share: the built site served on 127.0.0.1, Debian's Chromium
driven by Playwright, and ``open_page``, which loads a page with no internet.

Test modules use the fixtures ``site_url`` and ``browser`` and call ``open_page``;
``tools/screenshot.py`` (``make screenshot``) loads this file too, for the same
server, browser and page loading.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("BOOK_SITE", ROOT / "_build" / "html"))  # BOOK_SITE: check another build
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def site_pages(*folders: str) -> list[str]:
    """The built pages under these folders of the site, as paths relative to it."""
    if not SITE.exists():
        return []
    return sorted(path.relative_to(SITE).as_posix() for folder in folders for path in (SITE / folder).glob("*.html"))


def missing_prerequisite() -> str | None:
    """What the browser check lacks (the built site, Chromium), or None."""
    if not SITE.exists():
        return "the built site (run `make book`)"
    if CHROMIUM is None:
        return "Chromium (apt-get install chromium)"
    return None


def skip_or_fail_without_prerequisites() -> None:
    """Call at module level: skip the module where the site or Chromium is missing, fail under CI."""
    missing = missing_prerequisite()
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the browser test needs {missing}", pytrace=False)
    pytest.skip(f"needs {missing}", allow_module_level=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve_site(directory: Path = SITE) -> Iterator[str]:
    """Serve the built site on a free port of 127.0.0.1; yield its URL."""
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def launch_chromium():
    """Debian's Chromium under Playwright (Playwright never downloads a browser here)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def site_url():
    with serve_site() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with launch_chromium() as chromium:
        yield chromium


def open_page(browser, site_url: str, page_path: str, viewport: dict | None = None):
    """Load a page offline; return it with the console errors raised by our own files.

    Every request that leaves the site is aborted, as it would fail for a reader without a network.
    """
    page = browser.new_page(viewport=viewport or {"width": 1280, "height": 900})
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


def wait_for_math(page, timeout_ms: int = 45_000) -> bool:
    """Wait until MathJax has typeset the page (True), or say that it never started (False)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "() => !document.querySelector('.math')"
            " || Boolean(window.MathJax && MathJax.startup && MathJax.startup.promise)",
            timeout=timeout_ms,
        )
    except PlaywrightTimeout:
        return False
    page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")
    return True
