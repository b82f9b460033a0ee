"""Take the README's screenshot of the built book (``make screenshot``).

Uses the browser check's tooling (tests/browser/conftest.py): the site in
_build/html served on 127.0.0.1, Debian's Chromium under Playwright, pages
loaded with every outside request blocked, and math typeset by the MathJax the
site serves.  The viewport is tall enough to show the whole table of contents.

    python tools/screenshot.py --page chapters/04_lstm_one_unit.html --out book/assets/screenshot.png
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_browser_kit():
    spec = importlib.util.spec_from_file_location("browser_kit", ROOT / "tests" / "browser" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", default="chapters/04_lstm_one_unit.html", help="page of the built site")
    parser.add_argument("--out", default="book/assets/screenshot.png", help="PNG to write")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=1860)
    parser.add_argument("--scroll-to", default="", help="CSS selector to scroll into view first (optional)")
    args = parser.parse_args()

    kit = load_browser_kit()
    missing = kit.missing_prerequisite()
    if missing is not None:
        print(f"screenshot: needs {missing}", file=sys.stderr)
        return 1
    with kit.serve_site() as site_url, kit.launch_chromium() as browser:
        viewport = {"width": args.width, "height": args.height}
        page, errors = kit.open_page(browser, site_url, args.page, viewport=viewport)
        if not kit.wait_for_math(page):
            print(f"screenshot: MathJax did not typeset {args.page}", file=sys.stderr)
            return 1
        if args.scroll_to:
            page.locator(args.scroll_to).first.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out))
        page.close()
    if errors:
        print(f"screenshot: console errors on {args.page}: {errors}", file=sys.stderr)
        return 1
    print(f"==> wrote {args.out} ({args.width}x{args.height}) from {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
