#!/usr/bin/env bash
# kiln's runtime (torch and what `kiln generate` imports; no TVM compiler, ONNX, xgboost or
# transformers) for the emulated aarch64 Python of scripts/aarch64_python.sh, in
# SYSROOT/runtime-packages: scripts/aarch64_runtime.sh [SYSROOT]. Then, with <kiln parent> a folder
# holding the kiln package as `kiln`:
#   KILN_TVM_LIBRARY_DIR=SYSROOT/site-packages/tvm/lib PYTHONPATH=SYSROOT/runtime-packages:<kiln parent> \
#   SYSROOT/run -m kiln.cli generate ARTIFACT --target cpu:cortex-a76 ...
set -euo pipefail

root="$(realpath -m "${1:-${KILN_HOME:-$HOME/.cache/kiln}/aarch64-python}")"
dest="$root/runtime-packages"
host_python="${PYTHON:-python3}"
# torch 2.10.0: the last CPU-only aarch64 wheel on PyPI (2.11 and later pull CUDA 13) and the first with
# torch.Tensor.__dlpack_c_exchange_api__ (before it, tvm_ffi tries to JIT-compile an addon at each start).
# gguf (and pyyaml, which it imports) only because llm.py imports kiln.build, which imports the loaders.
wheels=(torch==2.10.0 safetensors==0.8.0 tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4
    gguf==0.19.0 pyyaml==6.0.4)
spec="${wheels[*]}"

[[ -x "$root/run" && -f "$root/.spec" ]] || { echo "no sysroot at $root: run scripts/aarch64_python.sh" >&2; exit 1; }
if [[ -e "$dest" && ! -f "$dest/.spec" ]]; then
    echo "$dest exists and was not made by this script; not replacing it" >&2
    exit 1
fi

if [[ "$(cat "$dest/.spec" 2>/dev/null)" != "$spec" ]]; then
    start=$SECONDS
    build="$(mktemp -d "$root/.runtime-packages.XXXXXX")"
    trap 'rm -rf "$build"' EXIT
    mkdir "$build/downloads"
    "$host_python" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version 3.11 --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
        --platform manylinux_2_17_aarch64 -d "$build/downloads" "${wheels[@]}"
    for wheel in "$build"/downloads/*.whl; do
        case "$(basename "$wheel")" in  # torch's C++ headers and test binaries: 150 MB, unused
            torch-*) unzip -q "$wheel" -d "$build" -x 'torch/include/*' 'torch/test/*' ;;
            *) unzip -q "$wheel" -d "$build" ;;
        esac
    done
    (cd "$build/downloads" && sha256sum -- *.whl) >"$build/SHA256SUMS"
    rm -rf "$build/downloads"

    # Without .pyc (PYTHONDONTWRITEBYTECODE may be set) `import torch` takes ~30 s instead of ~25 s.
    "$root/run" -m compileall -q -j0 -x '/(tests?|testing)/' "$build" >/dev/null
    echo "$spec" >"$build/.spec"
    rm -rf "$dest"  # has .spec: made by this script
    chmod 755 "$build"
    mv "$build" "$dest"
    echo "built $dest in $((SECONDS - start))s ($(du -sh "$dest" | cut -f1))"
fi

PYTHONPATH="$dest" "$root/run" -c '
import torch, safetensors, tokenizers, jinja2, gguf
from importlib import metadata
print("torch", torch.__version__, "tokenizers", tokenizers.__version__, "gguf", metadata.version("gguf"))
'
