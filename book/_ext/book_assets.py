"""Make the built book work offline, and tidy what our theme stack emits.

Math: Sphinx loads MathJax 3 (``es5/tex-mml-chtml.js``) from a public CDN, so a
reader offline sees every formula as raw TeX.  This extension fetches the same
MathJax release from the npm registry with ``npm pack`` (pinned, cached in
``book/vendor/``) and points ``mathjax_path`` at the copy in ``_static/mathjax/``;
MathJax finds its fonts (``output/chtml/fonts/woff-v2``) and the TeX extensions
it autoloads (``\\boldsymbol``, ``\\color``, ...) relative to that file, so they
come from the site too.  Without npm the CDN default stays, which still works for
readers online.  The files live in ``book/vendor/``, not in a folder named
``_static``, because Jupyter Book injects every script under ``_static`` into
every page.

No widget scripts: the chapters' controls are ``seqlib.notebook.interact``
players, plain HTML that needs no widget manager (``book_kernels`` switches them
on).  A chapter's stored metadata may still hold the widget state of its last
run in Jupyter, for which myst-nb would add RequireJS, the 3.6 MB widget manager
and the state itself to the page; a page that shows no widget view gets none of
them.

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

# npm package -> {pattern of files in its tarball: where they go under _static/
# (a name ending in "/" is a folder that keeps the file's own name; "{path}" stands for
# the file's path inside the tarball, less the leading "package/")}
VENDORED = {
    "mathjax@3.2.2": {f"package/es5/{pattern}": ("mathjax/{path}",) for pattern in MATHJAX_FILES},
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
        logger.info("[book_assets] npm not available: math will load its JavaScript from a CDN")
        return
    config.html_static_path = [*config.html_static_path, str(VENDOR_DIR)]
    config.mathjax_path = MATHJAX_JS  # relative: served from _static/


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def is_widget_script(app, script) -> bool:
    return script.attributes.get("type") == WIDGET_STATE or script.filename in app.config.nb_ipywidgets_js


def drop_duplicate_and_unused_scripts(app, pagename, templatename, context, doctree) -> None:
    shows_widgets = WIDGET_VIEW in context.get("body", "")
    seen, unique = set(), []
    for script in context.get("script_files", []):
        if not shows_widgets and is_widget_script(app, script):
            continue
        # inline scripts come with a filename of None or "" depending on who added them
        key = (script.filename or "", tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def setup(app):
    app.connect("config-inited", serve_scripts_locally)
    app.connect("html-page-context", drop_duplicate_and_unused_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
