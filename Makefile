# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all bench clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build; any other request would pull the CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m "slow or not slow"

bench: $(STAMP)
	$(PY) -m lightning_ckpt bench --json docs/bench-results.json

clean:
	rm -rf $(VENV) demo-output bench-results .pytest_cache *.egg-info
