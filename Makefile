# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu bench typecheck lint format protocol-header clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kalos demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

bench: $(STAMP)
	$(BIN)/python bench/bench_broker.py

typecheck: $(STAMP)
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protocol-header: $(STAMP)
	$(BIN)/python -c "from kalos.broker.layout import c_header; print(c_header(), end='')" > docs/kalos_protocol.h

clean:
	rm -rf $(VENV) .pytest_cache
