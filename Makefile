# The two commands: `make test` and `make serve`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

PEERS := .venv-peers

.PHONY: setup model test test-fast lint serve bench bench-peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/kiln pull $(MODEL)

test: model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: model
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The OpenAI-compatible server for $(MODEL); serves on 127.0.0.1:8000.
serve: model
	$(BIN)/kiln serve $(MODEL)

bench: model
	$(BIN)/python bench/reference.py

# Peers in their own venv (llama.cpp is compiled from source for this CPU: several minutes), then one
# side-by-side run on the same GGUF.
$(PEERS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check llama-cpp-python
	touch $@

bench-peers: model $(PEERS)/.installed
	$(PEERS)/bin/python bench/peers.py

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache .ruff_cache
