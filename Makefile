# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs, into
# one .venv: `make demo` the package alone (what `kalos demo` imports: its dependencies, no extra),
# `make test` the `dev` extra on top. The dev install is a superset and marks the demo's as done,
# so `make demo` after `make test` installs nothing, and `make test` after `make demo` adds only
# the dev extra (tests/ipc/test_docs_commands.py checks both orders with `make -n`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-gpu bench typecheck lint format protocol-header ext ops clean

# The compiled slot path (setup.py): built in place, again whenever a source changes. Optional: without
# a C compiler the build warns and Kalos runs the pure-Python slot path. With one, the suite requires
# the compiled path (KALOS_REQUIRE_COMPILED=1), so a broken build cannot pass as a Python-path run.
EXT_SRC := setup.py broker/kalos_protocol.h clients/_cslot.c sidecar_cuda/serving/_cserve.c
EXT_STAMP := build/.ext-stamp
HAVE_CC := $(shell command -v $${CC:-cc} 2> /dev/null)

# One install at a time into the one .venv, whatever -j says.
.NOTPARALLEL:

# The environment itself, with the build requirements of setup.py (the in-place build below runs it).
$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=77'

# `make demo`: Kalos and its dependencies, no extra (nothing to do where the dev install is current).
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	@if [ $(STAMP) -nt pyproject.toml ]; then echo "$(STAMP) is current: it has what the demo needs"; \
	else echo "$(BIN)/python -m pip install -q -e ."; $(BIN)/python -m pip install -q -e .; fi
	touch $(DEMO_STAMP)

# `make test` and the tools: the dev extra (tests, linters, type checker, framework adapters), a
# superset of the demo's install.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

$(EXT_STAMP): $(DEMO_STAMP) $(EXT_SRC)
	$(BIN)/python setup.py -q build_ext --inplace
	mkdir -p build && touch $@

ext: $(EXT_STAMP)

demo: $(DEMO_STAMP) $(EXT_STAMP)
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

# The blocking client's operations, generated from the pool's (clients/_unasync.py; a unit test
# fails while clients/_ops_sync.py is stale).
ops: $(STAMP)
	$(BIN)/python -m kalos.clients._unasync

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
