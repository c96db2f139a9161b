# Every target creates .venv on a fresh machine; nothing is assumed to be installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint types unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fabric demo

lint: $(STAMP)
	$(BIN)/ruff check fabricnode scheduler cli tests bench
	$(BIN)/ruff format --check fabricnode scheduler cli tests bench

types: $(STAMP)
	$(BIN)/mypy fabricnode scheduler cli

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint types unit

bench: $(STAMP)
	$(BIN)/python bench/gossip.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
