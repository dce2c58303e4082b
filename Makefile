# The two commands: `make test` and `make serve`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

.PHONY: setup model test test-fast lint serve bench clean

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
