#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench for THIS host, from the llama.cpp source vendored in
# the llama-cpp-python sdist on PyPI (scripts/llama_cpp_source.sh: pinned, sha256-checked). Used by
# `make bench-peers`.
#
#   scripts/build_llama_cpp.sh DEST
#       -> DEST/bin/llama-server, llama-bench, llama-batched-bench, llama-quantize
#          and DEST/src/.../vendor/llama.cpp (convert_hf_to_gguf.py, gguf-py) for scripts/make_shaped_gguf.py
#
# -DGGML_NATIVE=ON compiles for the host's instruction set (AVX2 only, AVX-512, VNNI...). Only what the
# host reports but cannot run is turned off: some VMs report AMX without enabling it, and llama.cpp's
# AMX kernels then die with an illegal instruction, so AMX is disabled unless KILN_LLAMA_AMX=1. Where AMX
# does run (an Intel Xeon with AMX under KVM, 2026-12-05: a tile multiply works), this llama.cpp's AMX
# build still segfaults in llama-bench on a Q4_K_M model, so the peer is built without it there too.
set -euo pipefail
dest=$(realpath -m "${1:?usage: build_llama_cpp.sh DEST}")
mkdir -p "$dest/bin"
source_dir=$(bash "$(dirname "$0")/llama_cpp_source.sh" "$dest/src" | tail -n 1)
flags=""
if grep -qw amx_tile /proc/cpuinfo && [ "${KILN_LLAMA_AMX:-0}" != 1 ]; then
  flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S "$source_dir" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >"$dest/cmake.log"
cmake --build "$dest/build" --target llama-server llama-bench llama-batched-bench llama-quantize -j "$(nproc)" >"$dest/build.log"
for tool in llama-server llama-bench llama-batched-bench llama-quantize; do cp "$dest/build/bin/$tool" "$dest/bin/"; done
isa=$(grep -qw avx512f /proc/cpuinfo && echo AVX-512 || (grep -qw avx2 /proc/cpuinfo && echo AVX2 || echo "no AVX2"))
echo "built $dest/bin/llama-server and llama-bench (llama.cpp from $source_dir, -march=native: $isa)"
