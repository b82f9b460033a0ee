"""A chapter's first cell installs what it needs into a bare Python, and does nothing where all is there.

The cells come from ``tools/install_cell.py`` (``test_chapter_outputs.py`` checks that every
chapter's is the generated one).  Here chapter 1's cell runs in a fresh virtual environment that
has only Python and pip, with the repository it clones pointed at this checkout
(``SEQLIB_REPOSITORY``: the clone holds what is committed); then the same Python imports seqlib
and the chapter's requirements without a restart, the chapter runs top to bottom in a kernel of
that environment, and the cell, run again with every package index out of reach, does nothing;
with one requirement removed it installs that one and leaves seqlib as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "01_tokens_to_vectors.ipynb"

sys.path.insert(0, str(ROOT / "tools"))
import install_cell  # noqa: E402

pytestmark = pytest.mark.slow


def run(command: list[str], env: dict, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    # from a folder of its own: `python -c` looks for modules in the working directory first
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.skipif(sys.platform != "linux", reason="the bare environment's MLX is the Linux CPU build")
def test_the_install_cell_makes_a_bare_python_run_the_chapter(tmp_path, monkeypatch):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to clone")
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=True)
    python = str(bare / "bin" / "python")
    env = {**os.environ, "SEQLIB_REPOSITORY": str(ROOT), "SEQLIB_CHECKOUT": str(tmp_path / "checkout")}
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    cell = install_cell.install_cell_source(json.loads(CHAPTER.read_text()))

    # 1. Only Python and pip: the cell installs, and this same process then imports all of it.
    imports = "\nimport seqlib.notebook, mlx.core, matplotlib, ipywidgets\nprint('imported', seqlib.__file__)"
    done = run([python, "-c", cell + imports], env, tmp_path)
    assert f"imported {tmp_path / 'checkout' / 'seqlib'}" in done.stdout, done.stdout

    # 2. The chapter, top to bottom, in a kernel of that environment (a Python with ipykernel).
    run([python, "-m", "pip", "install", "--quiet", "ipykernel"], env, tmp_path)
    spec = tmp_path / "kernels" / "kernels" / "bare"
    spec.mkdir(parents=True)
    argv = [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "bare", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "kernels"))
    nb = nbformat.read(CHAPTER, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="bare", resources={"metadata": {"path": str(CHAPTER.parent)}})
    client.execute(env=env)
    first = next(cell for cell in nb.cells if cell.cell_type == "code")
    assert "install-if-missing" in first.metadata.tags and first.outputs == []  # installed already: silent

    # 3. Everything there: the cell does nothing (no clone, no pip: both would fail here).
    offline = {**env, "SEQLIB_REPOSITORY": str(tmp_path / "nowhere"), "SEQLIB_CHECKOUT": str(tmp_path / "none"),
               "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}  # fmt: skip
    done = run([python, "-c", cell], offline, tmp_path, timeout=120)
    assert done.stdout == "" and not (tmp_path / "none").exists()

    # 4. One requirement missing: the cell installs it alone and leaves the installed seqlib (no clone).
    run([python, "-m", "pip", "uninstall", "--quiet", "--yes", "ipywidgets"], env, tmp_path)
    no_clone = {**env, "SEQLIB_REPOSITORY": str(tmp_path / "nowhere"), "SEQLIB_CHECKOUT": str(tmp_path / "none")}
    check = "\nimport ipywidgets, seqlib\nprint('seqlib from', seqlib.__file__)"
    done = run([python, "-c", cell + check], no_clone, tmp_path)
    assert f"seqlib from {tmp_path / 'checkout' / 'seqlib'}" in done.stdout and not (tmp_path / "none").exists()
