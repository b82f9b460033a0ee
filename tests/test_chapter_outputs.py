"""The chapters hold on every machine and in the static book: environment reports ignored, controls precomputed.

After the install cell, every chapter's first code cell sets up and prints the environment
(versions, the device, which path runs its kernels); a Mac prints it differently, so nbval
ignores that cell's output (tag ``nbval-ignore-output``). Any other cell that prints such a
report must be ignored too. Controls go through ``seqlib.notebook.interact``, which the static
book can play without a kernel.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import install_cell  # the install cells' generator

CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "chapters").glob("*.ipynb"))
IGNORE = "nbval-ignore-output"
INSTALL = install_cell.TAG
# what only an environment report prints
ENVIRONMENT = ("__version__", "default_device()", "metal_available()", "native.available()")


def code_cells(path):
    # the chapter's own code: not the install cell that tools/install_cell.py puts first
    cells = json.loads(path.read_text())["cells"]
    return [cell for cell in cells if cell["cell_type"] == "code" and INSTALL not in cell["metadata"].get("tags", [])]


def source(cell):
    return "".join(cell["source"])


def printed(cell):
    return "".join("".join(output.get("text", "")) for output in cell.get("outputs", []))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda path: path.stem)
def test_the_first_code_cell_is_an_ignored_environment_report(path):
    first = code_cells(path)[0]
    reports = any(name in source(first) for name in ENVIRONMENT) and printed(first)
    assert reports, "the first code cell should print the environment (versions, device, kernels' path)"
    assert IGNORE in first["metadata"].get("tags", [])


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda path: path.stem)
def test_cells_that_print_the_environment_are_ignored(path):
    for cell in code_cells(path):
        if printed(cell) and any(name in source(cell) for name in ENVIRONMENT):
            assert IGNORE in cell["metadata"].get("tags", []), source(cell)[:200]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda path: path.stem)
def test_controls_go_through_seqlib_notebook_interact(path):
    # ipywidgets' own interact (or a bare widget) would render in the static book as a control that
    # moves and changes nothing; seqlib.notebook.interact precomputes its outputs for the page.
    sources = [source(cell) for cell in code_cells(path)]
    assert any("interact(" in text and "from seqlib.notebook import" in "".join(sources) for text in sources)
    for text in sources:
        assert "widgets.interact" not in text and "display(widgets" not in text, text[:200]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda path: path.stem)
def test_the_first_cell_is_the_generated_install_cell(path):
    notebook = json.loads(path.read_text())
    first = next(cell for cell in notebook["cells"] if cell["cell_type"] == "code")
    assert install_cell.TAG in first["metadata"].get("tags", []), "run python tools/install_cell.py"
    assert "".join(first["source"]) == install_cell.install_cell_source(notebook), "run python tools/install_cell.py"
    assert first["outputs"] == [], "where everything is installed the cell prints nothing"
