# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu bench typecheck lint format protocol-header ext clean

# The compiled slot path (setup.py): built in place, again whenever a source changes. Optional: without
# a C compiler the build warns and Kalos runs the pure-Python slot path. With one, the suite requires
# the compiled path (KALOS_REQUIRE_COMPILED=1), so a broken build cannot pass as a Python-path run.
EXT_SRC := setup.py broker/kalos_protocol.h clients/_cslot.c sidecar_cuda/_cserve.c
EXT_STAMP := build/.ext-stamp
HAVE_CC := $(shell command -v $${CC:-cc} 2> /dev/null)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(EXT_STAMP): $(STAMP) $(EXT_SRC)
	$(BIN)/python setup.py -q build_ext --inplace
	mkdir -p build && touch $@

ext: $(EXT_STAMP)

demo: $(STAMP) $(EXT_STAMP)
	$(BIN)/kalos demo

test: $(STAMP) $(EXT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	KALOS_REQUIRE_COMPILED=$(if $(HAVE_CC),1,0) $(BIN)/python -m pytest -q
	@# The pure-Python slot path too (what an install without a compiler runs): the unit and ipc layers.
	KALOS_PURE_PYTHON=1 $(BIN)/python -m pytest -q tests/unit tests/ipc

test-gpu: $(STAMP) $(EXT_STAMP)
	$(BIN)/python -m pytest -q -m gpu

bench: $(STAMP) $(EXT_STAMP)
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
	$(BIN)/python -c "from kalos.broker.layout import c_header; print(c_header(), end='')" > broker/kalos_protocol.h

clean:
	rm -rf $(VENV) .pytest_cache build
	find broker clients sidecar_cuda -name '*.so' -delete
