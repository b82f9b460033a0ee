"""The chapters' stored outputs hold on every machine: only environment reports are machine-specific.

Every chapter's first code cell sets up and prints the environment (versions, the device, which
path runs its kernels); a Mac prints it differently, so nbval ignores that cell's output (tag
``nbval-ignore-output``). Any other cell that prints such a report must be ignored too.
"""

import json
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "chapters").glob("*.ipynb"))
IGNORE = "nbval-ignore-output"
# what only an environment report prints
ENVIRONMENT = ("__version__", "default_device()", "metal_available()", "native.available()")


def code_cells(path):
    return [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]


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
