# `make demo` and `make test` work on a fresh machine: they create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= 2.13.0

.PHONY: install demo test test-newest test-all check-wheel bench clean parity gpu-check

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU build; any other request would pull the CUDA packages.
	$(PY) -m pip install --quiet torch==$(TORCH)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Tests run in TEST_WORKERS pytest-xdist workers (0: in one process), each taking the next test as
# it frees up (worksteal: the long 2-rank tests do not all land on one worker at the end); 3 workers
# were no faster than 2 on the 2-core CI machine (the suite is CPU-bound once both cores are).
# Measured on a quiet fresh clone there (2026-12-07): `make test` 19.1 min (its install 1.5 min),
# `make check-wheel` 2.1 min, `make test-newest` 8.4 min (its install 3.2 min): CI 29.6 min; with
# the newest tier's skips below, CI 27.3 min (the suite 16.5 min, the newest tier's tests 3.7 min).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# The newest torch release this machine's pip installs (2.14.1; 2.15.0 is a several-GB CUDA build it
# does not serve by default), in a second environment, .venv-newest: the unit and integration
# tiers on it (CI runs both). Here torch 2.14.1 itself comes as the CUDA build (~2.7 GB of wheels;
# it runs on CPU, the gpu tests skip). The distributed and bench tiers stay on the pinned torch
# only, and so do the tests whose subject no torch version changes: process-level behaviour
# (SIGKILL campaigns, two processes sharing a folder, Ctrl-C, an orphaned writer), S3 through moto,
# LightningCLI's parsing, the demo script and the GPU check's report parsing.
# This tier also installs the `hf` extra (transformers): the Hugging Face tests run here and skip
# in `make test` (setup.cfg says why).
# Another torch: `make test-newest NEWEST_TORCH=2.15.0`.
NEWEST_TORCH ?= 2.14.1
NEWEST_TESTS ?= tests/unit tests/integration
NEWEST_SKIP ?= tests/integration/test_crash.py tests/integration/test_concurrency.py tests/integration/test_interrupt.py \
	tests/integration/test_writer_orphan.py tests/integration/test_s3.py tests/integration/test_cli_config.py \
	tests/integration/test_demo.py tests/unit/test_gpu_check.py
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed-torch-$(NEWEST_TORCH)

$(NEWEST_STAMP): setup.cfg pyproject.toml
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet --upgrade pip
	$(NEWEST_PY) -m pip install --quiet torch==$(NEWEST_TORCH)
	$(NEWEST_PY) -m pip install --quiet -e ".[test,hf]"
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -c "import torch, lightning; print('torch', torch.__version__, '/ lightning', lightning.__version__)"
	$(NEWEST_PY) -m pytest -q $(XDIST) $(NEWEST_TESTS) $(addprefix --ignore=,$(NEWEST_SKIP))

# The package as a user installs it (.ci/wheel-check): the wheel and sdist built with PyPA `build`
# (from the test extra), the wheel installed with torch first into a fresh venv, its command line
# run both ways from outside the repository, a fit and a resume, then inspect and verify.
check-wheel: $(STAMP)
	.ci/wheel-check $(PY) $(PYTHON) $(TORCH)

test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "slow or not slow"

# The package's user-facing benchmark (ShardedCheckpointIO's durable save against TorchCheckpointIO).
# The figures in docs/benchmarks.md come from the research versions, from a checkout:
# `$(PY) -m benchmarks --mode save|async` (loads, DCP, the disk's floor).
bench: $(STAMP)
	$(PY) -m lightning_ckpt bench --json docs/bench-results.json

# Every CUDA path and GPU figure in one command, for a borrowed GPU machine (docs/benchmarks.md,
# "On a GPU"): the GPU test tier and the GPU benchmarks, each step with its own timeout, in under
# 10 minutes on one H100; results in $(OUT)/ (gpu-check.json, .md, .log, gpu-check-reports.json).
# Where $(PYTHON) already has torch and lightning (the GPU image: no network, no venv) it runs from
# the source tree; elsewhere from $(VENV), where without CUDA every step is skipped in seconds.
#   make gpu-check [OUT=folder] [GPU_CHECK_ARGS="--steps gpu-tests,async-saves --timeout-scale 2"]
OUT ?= gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	@if $(PYTHON) -c "import torch, lightning" >/dev/null 2>&1; then \
		echo "gpu-check: $(PYTHON) from the source tree (PYTHONPATH=.)"; \
		PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m benchmarks.gpu_check --out "$(OUT)" $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) -s --no-print-directory $(STAMP) && $(PY) -m benchmarks.gpu_check --out "$(OUT)" $(GPU_CHECK_ARGS); \
	fi

# Lightning's own checkpoint tests, stock and with our callback / CheckpointIO (tests/parity/run.py).
# Not part of `test`. No PyPI sdist ships Lightning's tests, so they come from a clone:
#   git clone --filter=blob:none https://github.com/Lightning-AI/pytorch-lightning ~/pytorch-lightning
#   make parity LIGHTNING_SRC=~/pytorch-lightning [LIGHTNING_REF=2.6.6]  (default: the installed version)
# Extra test dependencies go into $(VENV) with the installed torch and lightning pinned.
PARITY_ARGS ?=
parity: $(STAMP)
	@test -n "$(LIGHTNING_SRC)" || { echo "make parity LIGHTNING_SRC=/path/to/pytorch-lightning (see the Makefile)"; exit 2; }
	mkdir -p tests/parity/.cache
	$(PY) -m pip freeze | grep -iE '^(torch|lightning|pytorch-lightning)==' > tests/parity/.cache/constraints.txt
	$(PY) -m pip install --quiet -c tests/parity/.cache/constraints.txt -r tests/parity/requirements.txt
	$(PY) tests/parity/run.py --src "$(LIGHTNING_SRC)" $(if $(LIGHTNING_REF),--ref "$(LIGHTNING_REF)") $(PARITY_ARGS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) demo-output bench-results .pytest_cache *.egg-info
