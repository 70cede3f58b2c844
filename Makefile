# The two commands of the README: `make demo` (main job on CPU) and `make test` (lint + tests).
# Both build .venv with pinned dependencies first. torch is installed before anything else so
# that pip takes the pinned CPU wheel and never resolves an unpinned (multi-GB CUDA) build.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONSTRAINTS := requirements/constraints-cpu.txt
PYTEST_ARGS ?=

.PHONY: venv demo test lint format clean

venv: $(STAMP)

$(STAMP): setup.py $(CONSTRAINTS)
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; megatron_iso's CPU environment needs Python 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev,hf]'
	# FLA (the performance profile's GDN rollout on cuda) in a side directory that only the interpreter test's
	# children import: imported in the main environment, it would bind transformers' Qwen3-Next / Qwen3.5 GDN
	# functions to kernels that cannot run on a CPU (tests/ops/test_gdn_fla_interpret.py).
	$(BIN)/pip install -q --no-deps --target $(VENV)/fla-site fla-core==0.6.0 einops==0.8.2
	@touch $(STAMP)

# GRPO on the tiny dense model, CPU, correctness profile: reward rises, mismatch stays exactly 0.
DEMO_ARGS ?=
demo: venv
	$(BIN)/iso-train out_dir=runs/demo-$$(date +%Y%m%d-%H%M%S) $(DEMO_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# pytest exits 5 when no test ran: that is a failure here, as any non-zero exit.
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
