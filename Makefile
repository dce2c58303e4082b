# The two commands: `make test` and `make serve`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=

PEERS := .venv-peers

.PHONY: setup model test test-fast lint serve bench bench-peers bench-compare clean

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

# Peers in their own venv (llama.cpp is compiled from source: several minutes), then one side-by-side
# run on the same GGUF. AVX-512 (VNNI, BF16) but no AMX: some VMs report AMX without enabling it, and
# llama.cpp's AMX kernels then die with an illegal instruction.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
$(PEERS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check \
		--no-cache-dir --force-reinstall --no-deps llama-cpp-python
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check llama-cpp-python
	touch $@

bench-peers: model $(PEERS)/.installed
	$(PEERS)/bin/python bench/peers.py

# Every backend and llama.cpp side by side (docs/benchmarks.md); artifacts are compiled once into
# $KILN_HOME/bench-compare. The llama.cpp row needs .venv-peers (make bench-peers), n/a without it.
# More flags: make bench-compare COMPARE_ARGS="--skip ort ort-int4 --repeats 5"
COMPARE_ARGS ?=
bench-compare: model
	$(BIN)/python bench/compare.py --model $(MODEL) $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache .ruff_cache
