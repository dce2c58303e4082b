#!/usr/bin/env bash
# Fetch llama.cpp's source as vendored in the llama-cpp-python sdist on PyPI (checked by sha256) and unpack it.
#
#   scripts/llama_cpp_source.sh [DEST] [--python-only]
#       -> DEST/llama_cpp_python-VERSION/vendor/llama.cpp   (its path is the last line printed)
#
# DEST defaults to $KILN_HOME/llama.cpp-source (KILN_HOME defaults to ~/.cache/kiln). --python-only
# unpacks just what converting needs (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py/:
# a few MB of the 217) and ggml's reference quantizers (ggml-quants.c and its headers: the tests compile them
# to check kiln's GGUF block encoder against),
# as `make test` does for the loader checks against llama.cpp's own GGUF files; scripts/build_llama_cpp.sh
# unpacks all of it to build the tools. A rerun reuses what is there.
set -euo pipefail
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dest=${1:-${KILN_HOME:-$HOME/.cache/kiln}/llama.cpp-source}
part=${2:-}
mkdir -p "$dest"
dest=$(realpath "$dest")
archive="$dest/llama_cpp_python-$version.tar.gz"
top="llama_cpp_python-$version"
source_dir="$dest/$top/vendor/llama.cpp"
if [ ! -f "$archive" ]; then
  "${PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dest"
fi
echo "$sha256  $archive" | sha256sum --check --quiet - || {
  echo "error: $archive does not have the pinned sha256 $sha256: delete it and rerun" >&2
  exit 1
}
if [ "$part" = --python-only ]; then
  if [ ! -f "$source_dir/convert_lora_to_gguf.py" ] || [ ! -f "$source_dir/ggml/src/ggml-quants.c" ]; then
    vendor="$top/vendor/llama.cpp"
    members=("$vendor/convert_hf_to_gguf.py" "$vendor/convert_lora_to_gguf.py" "$vendor/conversion"
      "$vendor/gguf-py" "$vendor/ggml/include" "$vendor/ggml/src/ggml-quants.c" "$vendor/ggml/src/ggml-quants.h"
      "$vendor/ggml/src/ggml-common.h" "$vendor/ggml/src/ggml-impl.h" "$vendor/ggml/src/ggml-cpu/ggml-cpu-impl.h")
    tar -xzf "$archive" -C "$dest" "${members[@]}"
  fi
elif [ ! -f "$source_dir/CMakeLists.txt" ]; then
  tar -xzf "$archive" -C "$dest"
fi
echo "$source_dir"
