# Two commands matter:  `make book` builds the book,  `make test` runs every check.
# Both create .venv and install what they need first, so they work on a fresh clone.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
SANITIZE := tests/nbval_sanitize.cfg
NBVAL    := $(BIN)/python -m pytest --nbval chapters --nbval-sanitize-with $(SANITIZE) -p no:randomly

# Other float32 numerics than this machine's default, as another CPU would give them:
# OpenBLAS's SSE3 kernels for MLX's matmuls (other blocking, other summation order),
# one thread, and PyTorch without AVX2 (ATen's scalar kernels, MKL limited to SSE4.2,
# oneDNN to SSE4.1). On CPUs other than x86-64 only the thread count is changed.
ifeq ($(shell uname -m),x86_64)
OTHER_NUMERICS := OPENBLAS_CORETYPE=Prescott OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
                  ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
else
OTHER_NUMERICS := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
endif

.DEFAULT_GOAL := help
.PHONY: help book test lab unit unit-emulate nbval nbval-numerics nbval-mac-cpu nbval-mac-gpu kernel-stress lint book-strict browser-test screenshot clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

# pip prints what it collects, downloads and installs, with progress bars. PYTHONWARNINGS drops
# exactly one note that setuptools prints on every editable install of a package with a
# package-dir mapping (metal_kernels/ -> seqlib/metal_kernels): "Editable installation. Please be
# careful with folders in your working directory with the same name as your package".
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip

# On Linux PyPI's torch wheel brings several GB of CUDA libraries; the book and the tests use
# the CPU. tools/install-torch.sh installs the pinned torch's CPU build from PyTorch's CPU index
# first (on macOS PyPI's wheel is the CPU/MPS one already, and the script does nothing).
TORCH_PIN := $(shell sed -n 's/^\(torch==[0-9.]*\).*/\1/p' requirements.txt)

$(BIN)/python:
	@echo "==> [1/4] creating a virtual environment in $(VENV) with $$($(PYTHON) --version)"
	@$(PYTHON) -c 'import sys; sys.exit("Python 3.10 or newer is needed") if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)
	@echo "==> [1/4] upgrading pip in $(VENV)"
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch-installed: requirements.txt | $(BIN)/python
	@sh tools/install-torch.sh "$(BIN)/python" "$(TORCH_PIN)"
	@touch $@

$(VENV)/.book-installed: requirements.txt pyproject.toml | $(VENV)/.torch-installed
	@echo "==> [3/4] installing the book's requirements (requirements.txt: MLX, Jupyter Book, matplotlib, ...)"
	@echo "    and seqlib itself, editable, from this folder"
	$(PIP) install -r requirements.txt
	@touch $@

$(VENV)/.test-installed: requirements-test.txt $(VENV)/.book-installed
	@echo "==> [4/4] installing the test tools (requirements-test.txt: pytest, nbval, ruff, playwright, ...)"
	$(PIP) install -r requirements-test.txt
	@touch $@

# The book is rebuilt (every chapter executed) only when something it is made from changed: the
# chapters, the library, the kernels, the book's own pages and extension, its configuration, or
# the requirements. `make test` right after `make book` reuses the build; `make clean` forces one.
BOOK_STAMP   := _build/.book-built
BOOK_SOURCES := $(wildcard chapters/*.ipynb _config.yml _toc.yml requirements.txt pyproject.toml metal_kernels/*) \
                $(shell find seqlib book -type f \( -name '*.py' -o -name '*.c' -o -name '*.cpp' -o -name '*.h' -o -name '*.md' \
                    -o -name '*.bib' -o -name '*.js' -o -name '*.css' -o -name '*.rst' -o -name '*.svg' -o -name '*.png' \
                    -o -name '*.wav' -o -name '*.ipynb' \) -not -path 'book/vendor/*' -not -name 'screenshot*.png' -not -path '*/__pycache__/*' \
                    -not -path '*/.ipynb_checkpoints/*' 2>/dev/null)

book: $(BOOK_STAMP)  ## build the book into _build/html (runs every chapter; skipped when nothing changed)
	@echo "==> the book in _build/html matches its sources: open _build/html/index.html"

$(BOOK_STAMP): $(BOOK_SOURCES) $(VENV)/.book-installed
	@echo "==> [$$(date +%T)] building the book: every notebook is executed; any error or warning fails the build"
	@rm -f $@
	$(BIN)/jupyter-book build --all -W --keep-going .
	@touch $@

# `make test` runs the checks that use every core one after another (ruff, the unit tests, the book
# build, nbval as built), then the other four side by side, two at a time (TWO_AT_ONCE), each on one
# thread. One thread each, because a pass with two threads beside another one starves: OpenBLAS's
# threads wait for each other while the other pass holds a core (SEQLIB_NATIVE=0 ran three times
# slower that way). Every one of the four checks what a thread count does not decide (nbval-numerics
# runs on one thread by design), and on two cores two one-thread passes each run at their own speed.
TWO_AT_ONCE := nbval-mac-cpu nbval-numerics nbval-mac-gpu browser-test

test: lint unit unit-emulate book nbval  ## everything: ruff, unit tests (ops and emulated kernels), book, nbval (four ways), browser check
	@echo "==> [$$(date +%T)] two at a time, one thread each (each check's output shows when it ends): $(TWO_AT_ONCE)"
	@OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(MAKE) --no-print-directory -j2 --output-sync=target $(TWO_AT_ONCE)
	@echo "==> [$$(date +%T)] all checks passed"

lint: $(VENV)/.test-installed  ## ruff on the library, tests and notebooks
	@echo "==> [$$(date +%T)] ruff check"
	$(BIN)/ruff check .

unit: $(VENV)/.test-installed  ## the library's unit tests (seqlib against PyTorch)
	@echo "==> [$$(date +%T)] unit tests"
	$(BIN)/python -m pytest tests --ignore=tests/browser

# The modules' torch-parity tests again, with every module on its Metal path through seqlib.emulation.
PARITY_TESTS := tests/test_cells.py tests/test_embedding.py tests/test_embedding_bag.py tests/test_recurrent_layers.py \
                tests/test_sparse.py tests/test_packing.py tests/test_interop.py tests/test_streaming.py

unit-emulate: $(VENV)/.test-installed  ## the torch-parity tests with SEQLIB_BACKEND=emulate (the kernels, emulated)
	@echo "==> [$$(date +%T)] torch-parity tests on the emulated Metal kernels (SEQLIB_BACKEND=emulate)"
	SEQLIB_BACKEND=emulate $(BIN)/python -m pytest $(PARITY_TESTS) -p no:randomly

# Where the built book matches its sources (in `make test`, which builds it first), each chapter's
# kernel then also recomputes a sample of the chapter page's precomputed controls and compares them
# with the page (tests/nbval_players.py): what a reader sees online is what a kernel would show.
PLAYERS := -p tests.nbval_players --players-site _build/html
# Through a variable, so that `make -n nbval` runs nothing (make runs a recipe line naming $(MAKE) even under -n).
BOOK_IS_CURRENT = $(MAKE) --no-print-directory -q $(BOOK_STAMP)

nbval: $(VENV)/.test-installed  ## re-run every chapter and compare with its stored outputs (and the built pages' controls)
	@echo "==> [$$(date +%T)] nbval: re-running the chapters against their stored outputs"
	@if $(BOOK_IS_CURRENT); then \
	    echo "    and the built pages' controls against each chapter's kernel"; players="$(PLAYERS)"; \
	else echo "    (no built book matching the sources: the pages' controls are not checked; make book first)"; fi; \
	set -x; $(NBVAL) $$players

nbval-numerics: $(VENV)/.test-installed  ## nbval again under other float32 numerics (other BLAS kernels, one thread)
	@echo "==> [$$(date +%T)] nbval under other numerics: $(OTHER_NUMERICS)"
	env $(OTHER_NUMERICS) $(NBVAL)

# The paths a Mac takes, as far as Linux can take them (the environment-report cells, the first code
# cell of every chapter, are the only ones whose output may differ; nbval ignores them):
# - a Mac's CPU has no C++ primitives of seqlib's (they are built for Linux's MLX): SEQLIB_NATIVE=0
#   sends every module through MLX ops, as there;
# - a Mac's GPU runs seqlib's Metal kernels: SEQLIB_BACKEND=emulate runs the same kernels through
#   seqlib.emulation. Parts I and II (chapters 1-7, the library's modules on their default path)
#   take a few minutes that way; Parts III-V choose their backends cell by cell already, and their
#   larger models would take hours emulated.
MAC_GPU_CHAPTERS := $(wildcard chapters/0[1-7]_*.ipynb)

nbval-mac-cpu: $(VENV)/.test-installed  ## nbval with seqlib's C++ primitives off (SEQLIB_NATIVE=0: the path a Mac's CPU takes)
	@echo "==> [$$(date +%T)] nbval with SEQLIB_NATIVE=0 (MLX ops where the C++ primitives would run)"
	SEQLIB_NATIVE=0 $(NBVAL)

nbval-mac-gpu: $(VENV)/.test-installed  ## nbval of chapters 1-7 with the Metal kernels emulated (the path a Mac's GPU takes)
	@echo "==> [$$(date +%T)] nbval of chapters 1-7 with SEQLIB_BACKEND=emulate (seqlib's Metal kernels through seqlib.emulation)"
	SEQLIB_BACKEND=emulate $(BIN)/python -m pytest --nbval $(MAC_GPU_CHAPTERS) --nbval-sanitize-with $(SANITIZE) -p no:randomly

# Kernel starts and executions as the book build makes them (book/_ext/book_kernels.py), two at a
# time; a run over three times the median, or one that fails, fails the target. About 3 minutes.
kernel-stress: $(VENV)/.book-installed  ## start and run chapter 4's kernel 50 times, two at once; fail on any stall
	$(BIN)/python tools/kernel_stress.py --runs 50 --parallel 2

browser-test: $(VENV)/.test-installed  ## open the built site in headless Chromium (needs `make book` first)
	@echo "==> [$$(date +%T)] browser check of _build/html in headless Chromium"
	@sh tools/ensure-chromium.sh
	$(BIN)/python -m pytest tests/browser

screenshot: $(VENV)/.test-installed book  ## regenerate the README's screenshot from the built book (headless Chromium)
	@sh tools/ensure-chromium.sh
	$(BIN)/python tools/screenshot.py --out book/assets/screenshot.png

lab: $(VENV)/.book-installed  ## open the chapters in JupyterLab
	$(BIN)/jupyter lab chapters/

clean:  ## remove the built book and caches (keeps .venv)
	rm -rf _build book/vendor .pytest_cache .hypothesis .ruff_cache
