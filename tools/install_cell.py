"""Write (or check) the install cell at the top of every chapter.

A reader who opens a chapter outside the book's environment (a launch button's Colab or Binder,
a fresh Python with a Jupyter kernel) runs the chapter's first cell, which installs seqlib from a
clone of the repository (editable, so the chapter finds ``tools/`` and ``metal_kernels/`` beside
it, as chapter 9 does) together with what that chapter imports, when any of it is missing; where
everything is there already (the book build, nbval, ``make lab``) the cell does nothing.

The cells are generated here, from one template, so that they cannot drift: the repository's
address is ``repository.url`` in ``_config.yml`` (the launch buttons use it too), and each
chapter's list is what its code cells import (``REQUIREMENTS`` maps modules to pip names).

    python tools/install_cell.py            # rewrite the cells
    python tools/install_cell.py --check    # exit 1 if a chapter's cell is not the generated one
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
TAG = "install-if-missing"

# module a chapter imports -> what pip installs for it (modules seqlib itself brings are left out)
REQUIREMENTS = {
    "ipywidgets": "ipywidgets",
    "matplotlib": "matplotlib",
    "pandas": "pandas",
    "silero_vad": "silero-vad",
    "sklearn": "scikit-learn",
    "sktime": "sktime",
    "statsmodels": "statsmodels",
    "threadpoolctl": "threadpoolctl",
    "torch": "torch",
}

TEMPLATE = """\
# Opened outside the book's environment (Colab, Binder, a fresh Python)? This cell installs
# seqlib from a clone of its repository, and what this chapter imports, when any of it is
# missing. Where everything is installed, it does nothing.
def install_if_missing():
    import importlib.util
    import os
    import site
    import subprocess
    import sys
    from pathlib import Path

    needed = {{  # module this chapter imports: its pip requirement
{needed}
    }}
    def present(module):
        try:
            return importlib.util.find_spec(module) is not None
        except ImportError:  # "seqlib.notebook" where no seqlib (or a broken one) is installed
            return False

    missing = [requirement for module, requirement in needed.items() if not present(module)]
    install = missing
    if not present("seqlib.notebook"):  # an installed seqlib is left as it is
        checkout = Path(os.environ.get("SEQLIB_CHECKOUT", Path.home() / "seqlib-book"))
        if not (checkout / "pyproject.toml").exists():
            repository = os.environ.get("SEQLIB_REPOSITORY", "{repository}")
            subprocess.run(["git", "clone", "--quiet", "--depth=1", repository, str(checkout)], check=True)
        install = ["-e", str(checkout), *missing]
    if not install:
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *install], check=True)
    for folder in site.getsitepackages():  # an editable install's .pth, in this running kernel
        site.addsitedir(folder)
    importlib.invalidate_caches()


install_if_missing()"""


def repository_url() -> str:
    found = re.search(r"^repository:\s*\n(?:\s+.*\n)*?\s+url:\s*(\S+)", (ROOT / "_config.yml").read_text(), re.M)
    if found is None:
        sys.exit("_config.yml has no repository.url")
    return found.group(1)


def imported_modules(notebook: dict) -> set[str]:
    code = "\n".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code")
    return set(re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M))


def install_cell_source(notebook: dict) -> str:
    modules = sorted(imported_modules(notebook) & set(REQUIREMENTS))
    needed = "\n".join(f'        "{module}": "{REQUIREMENTS[module]}",' for module in modules)
    return TEMPLATE.format(needed=needed, repository=repository_url())


def with_install_cell(notebook: dict) -> dict:
    """The notebook with its install cell (added before the first code cell, or brought up to date)."""
    cells = notebook["cells"]
    text = install_cell_source(notebook)
    existing = [i for i, cell in enumerate(cells) if TAG in cell.get("metadata", {}).get("tags", [])]
    cell = {
        "cell_type": "code", "execution_count": None, "id": "install-if-missing",
        "metadata": {"tags": [TAG, "hide-input"]}, "outputs": [], "source": text.splitlines(keepends=True),
    }  # fmt: skip
    if existing:
        cells[existing[0]] = {**cells[existing[0]], "source": cell["source"], "metadata": cell["metadata"]}
    else:
        first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
        cells.insert(first_code, cell)
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 where a cell differs")
    args = parser.parse_args()
    stale = []
    for path in CHAPTERS:
        text = path.read_text()
        updated = json.dumps(with_install_cell(json.loads(text)), indent=1, ensure_ascii=False) + "\n"
        if updated != text:
            stale.append(path.name)
            if not args.check:
                path.write_text(updated)
    if args.check and stale:
        print("install cells out of date (run python tools/install_cell.py):", ", ".join(stale))
        return 1
    print(f"{len(CHAPTERS) - len(stale)} chapters up to date" + ("" if args.check else f", {len(stale)} rewritten"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
