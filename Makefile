# Quick start:  make demo   (set up, run the Fashion-MNIST MCD reproduction, print the table)
#               make test   (set up, run the whole test suite)
# Also:         make lab    (JupyterLab on the notebooks), make site (the static site),
#               make test-full (every notebook in full mode, headless)
# The first Python >= 3.11 found (3.11 is the one tested); override with make PYTHON=/path/to/python.
PYTHON ?= $(firstword $(foreach p,python3.11 python3.12 python3.13 python3,$(shell command -v $(p) >/dev/null 2>&1 && $(p) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo $(p))))
VENV   := .venv
PY     := $(VENV)/bin/python
APT_PACKAGES := graphviz dataset-fashion-mnist
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# Notebooks that `make demo` executes (quick mode) into build/notebooks/ as .ipynb and .html.
DEMO_NOTEBOOKS ?= $(wildcard notebooks/0[1-4]_*.ipynb)

.PHONY: demo test test-full site lab system-deps notebooks clean

# The virtual environment, then pip. pip would compile every installed module to bytecode on one
# core (about 90 s of the 5.5 GB torch install); compileall does it on every core instead, and
# skips the installed packages' own test suites, which nothing here imports (a quarter of the
# code: 54 -> 33 s on 2 cores). A few files written for newer Pythons do not compile
# (torch/testing/_internal/py312_intrinsics.py on 3.11): pip skips them too, and no import reads
# them, hence the `|| true`.
define install
	@[ -n "$(PYTHON)" ] && command -v $(PYTHON) >/dev/null || { echo "error: no Python >= 3.11 found (looked for python3.11, python3.12, python3.13, python3); install one (sudo apt-get install python3.11) or run make PYTHON=/path/to/python3"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e '$(1)'
	$(PY) -m compileall -q -j 0 -x '/tests?/|/testing/_internal/' $(VENV)/lib >/dev/null || true
endef

$(VENV)/.core: pyproject.toml
	$(call install,.)
	touch $@

# The dev extra installs the package too, in the same pip call (one resolve instead of two).
$(VENV)/.dev: pyproject.toml
	$(call install,.[dev])
	touch $(VENV)/.core $@

# Debian packages: Graphviz's `dot` (torchviz graphs) and Fashion-MNIST (the ID set), with apt
# when we are root and apt is there; otherwise say what to install.
system-deps:
	@missing=""; for p in $(APT_PACKAGES) $(EXTRA_APT); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing with apt:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
		echo "note: please install these Debian/Ubuntu packages:$$missing (sudo apt-get install$$missing)."; \
		echo "      Without them: no rendered graphs, and Fashion-MNIST is looked for in \$$MCD_DATA_DIR or downloaded."; \
	fi

# DEMO_FLAGS=--resume continues an interrupted demo, DEMO_FLAGS=--fresh starts it over. (make -n demo
# runs it all the same: its one recipe line calls $(MAKE), which -n executes.)
# Prints the seconds of each part: install, reproduction (its stages are in runs/demo/run.json), notebooks.
demo: system-deps
	@t0=$$(date +%s); $(MAKE) --no-print-directory $(VENV)/.core && t1=$$(date +%s) && \
	$(PY) -m mcd_helpers reproduce --preset quick --out runs/demo $(DEMO_FLAGS) && t2=$$(date +%s) && \
	$(MAKE) --no-print-directory notebooks NOTEBOOKS="$(DEMO_NOTEBOOKS)" && t3=$$(date +%s) && \
	echo && echo "Results: runs/demo/results.md (table above), plots in runs/demo/; executed notebooks in build/notebooks/" && \
	echo "make demo: install $$((t1 - t0)) s, reproduction $$((t2 - t1)) s, notebooks $$((t3 - t2)) s, in all $$((t3 - t0)) s"

# Execute notebooks headless in quick mode; executed copies and HTML go to build/notebooks/.
NOTEBOOKS ?= $(wildcard notebooks/*.ipynb)
notebooks: $(VENV)/.core
	@mkdir -p build/notebooks
	MCD_QUICK=1 $(VENV)/bin/jupyter nbconvert --log-level WARN --to notebook --execute --ExecutePreprocessor.timeout=900 --output-dir build/notebooks $(NOTEBOOKS)
	$(VENV)/bin/jupyter nbconvert --log-level WARN --to html $(addprefix build/notebooks/,$(notdir $(NOTEBOOKS)))

# Tests run on TEST_WORKERS pytest-xdist workers, a test file (the notebooks' three files: one
# group) to a worker; make test TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
# The layout first (ruff, pinned in pyproject.toml: the code, the tests and the notebooks' cells), then
# the tests.
test: EXTRA_APT += chromium  # the notebooks' browser tests
test: system-deps $(VENV)/.dev
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/ruff check
	$(PY) -m pytest -n $(TEST_WORKERS) -ra --durations=20

# Every notebook top to bottom in full mode (what make lab runs), headless; not part of make test.
# Wall times go to build/notebook_times_full.json, executed copies to build/executed-full/.
test-full: system-deps $(VENV)/.dev
	MCD_FULL=1 $(PY) -m pytest -ra -s -m notebook tests/test_notebooks.py

# The static site (README as landing page, the notebooks executed in quick mode, docs/) in
# build/site/; reuses the copies make test executed, executes the missing ones (docs/build_site.py).
site: system-deps $(VENV)/.dev
	$(PY) docs/build_site.py

lab: system-deps $(VENV)/.core
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 $$( [ "$$(id -u)" = 0 ] && echo --allow-root ) notebooks/

# build/ (executed notebooks, the site, the test suite's own cache) and pytest's cache; runs/ holds
# your results and the data cache (docs/data.md) your data and networks: neither is touched.
clean:
	rm -rf build .pytest_cache
