"""Make the built book work offline, and tidy two scripts our theme stack emits.

Math: Sphinx loads MathJax 3 (``es5/tex-mml-chtml.js``) from a public CDN, so a
reader offline sees every formula as raw TeX.  This extension fetches the same
MathJax release from the npm registry (below, with the widget scripts) and
points ``mathjax_path`` at the copy in ``_static/mathjax/``; MathJax finds its
fonts (``output/chtml/fonts/woff-v2``) and the TeX extensions it autoloads
(``\\boldsymbol``, ``\\color``, ...) relative to that file, so they come from
the site too.  Without npm the CDN default stays, as for the widgets.

Widgets: myst-nb renders saved widget state with RequireJS and
``@jupyter-widgets/html-manager``'s ``embed-amd.js``, by default from public
CDNs, so a reader offline (or our browser test, which has no internet) sees an
empty widget area.  At build time this extension fetches both packages from the
npm registry with ``npm pack`` (pinned versions, cached in ``book/vendor/``),
serves the files from ``_static/`` and points myst-nb at them, together with a
small adapter script (``static/widgets-offline.js``).  Without npm it logs a
note and keeps myst-nb's CDN defaults, which still work for readers online.
The files live in ``book/vendor/``, not in a folder named ``_static``, because
Jupyter Book injects every script under ``_static`` into every page.

Duplicate scripts: sphinx-thebe adds its inline ``const THEBE_JS_URL = ...``
twice to every page, which throws "already declared" in the browser console;
we drop exact duplicates from each page's script list.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
VENDOR_DIR = HERE.parent / "vendor"
ADAPTER = "widgets-offline.js"
REQUIRE_JS = "require-2.3.8.js"
EMBED_JS = "embed-amd-1.0.15.js"
# The MathJax that Sphinx 7's default mathjax_path names (mathjax@3, es5/tex-mml-chtml.js), pinned.
MATHJAX_JS = "mathjax/es5/tex-mml-chtml.js"
MATHJAX_FILES = (
    "tex-mml-chtml.js",
    "output/chtml/fonts/woff-v2/*.woff",  # the CHTML fonts
    "input/tex/extensions/*.js",  # TeX packages that tex-mml-chtml loads on first use
    "input/mml/extensions/*",
    "a11y/*.js",  # what the right-click menu loads on request
    "ui/*.js",
)

FONT_KINDS = ("woff2", "woff", "ttf", "eot", "svg")
FONT_FOLDERS = ("@jupyter-widgets/", "@jupyter-widgets/html-manager/dist/")

# npm package -> {pattern of files in its tarball: where they go under _static/
# (a name ending in "/" is a folder that keeps the file's own name; "{path}" stands for
# the file's path inside the tarball, less the leading "package/")}
VENDORED = {
    "mathjax@3.2.2": {f"package/es5/{pattern}": ("mathjax/{path}",) for pattern in MATHJAX_FILES},
    "requirejs@2.3.8": {"package/require.js": (REQUIRE_JS,)},
    "@jupyter-widgets/html-manager@1.0.15": {
        "package/dist/embed-amd.js": (EMBED_JS,),
        # Icon fonts. The bundle holds two webpack modules that each look for them beside
        # their own module id (@jupyter-widgets/html-manager and .../dist/libembed-amd),
        # and which one asks first varies from load to load, so they go in both places.
        **{f"package/dist/*.{kind}": FONT_FOLDERS for kind in FONT_KINDS},
    },
}


def _extract(tarball: Path, patterns: dict[str, tuple[str, ...]], into: Path) -> None:
    with tarfile.open(tarball) as archive:
        for member in archive.getmembers():
            for pattern, destinations in patterns.items():
                if not (member.isfile() and fnmatch.fnmatch(member.name, pattern)):
                    continue
                content = archive.extractfile(member).read()
                for destination in destinations:
                    name = Path(member.name).name if destination.endswith("/") else ""
                    inner = member.name.removeprefix("package/")
                    target = into / destination.format(path=inner) / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)


def vendor_scripts() -> bool:
    """Fill book/vendor with the pinned files; return False if they cannot be had."""
    stamp = VENDOR_DIR / ".fetched"
    wanted = repr(VENDORED)  # any change to the list fetches afresh
    if stamp.exists() and stamp.read_text() == wanted:
        return True
    if shutil.which("npm") is None:
        return False
    shutil.rmtree(VENDOR_DIR, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for spec, patterns in VENDORED.items():
                packed = subprocess.run(
                    ["npm", "pack", spec, "--silent", "--pack-destination", scratch],
                    capture_output=True, text=True, check=True, timeout=300,
                )  # fmt: skip
                _extract(Path(scratch) / packed.stdout.strip().splitlines()[-1], patterns, VENDOR_DIR)
                logger.info(f"[book_assets] vendored {spec}")
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as error:
        logger.info(f"[book_assets] could not fetch the scripts with npm ({error})")
        shutil.rmtree(VENDOR_DIR, ignore_errors=True)
        return False
    stamp.write_text(wanted)
    return True


def serve_scripts_locally(app, config) -> None:
    if not vendor_scripts():
        logger.info("[book_assets] npm not available: math and widgets will load their JavaScript from CDNs")
        return
    config.html_static_path = [*config.html_static_path, str(HERE / "static"), str(VENDOR_DIR)]
    config.nb_ipywidgets_js = {ADAPTER: {}, REQUIRE_JS: {}, EMBED_JS: {}}
    config.mathjax_path = MATHJAX_JS  # relative: served from _static/


def drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    seen, unique = set(), []
    for script in context.get("script_files", []):
        # inline scripts come with a filename of None or "" depending on who added them
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("config-inited", serve_scripts_locally)
    app.connect("html-page-context", drop_duplicate_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
