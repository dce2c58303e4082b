#!/usr/bin/env bash
# kiln's runtime (what `kiln generate` of a CPU artifact imports; no torch, TVM compiler, ONNX, xgboost
# or transformers) for the emulated aarch64 Python of scripts/aarch64_python.sh, in
# SYSROOT/runtime-packages: scripts/aarch64_runtime.sh [SYSROOT]. Then, with <kiln parent> a folder
# holding the kiln package as `kiln`:
#   KILN_TVM_LIBRARY_DIR=SYSROOT/site-packages/tvm/lib PYTHONPATH=SYSROOT/runtime-packages:<kiln parent> \
#   SYSROOT/run -m kiln.cli generate ARTIFACT --target cpu:cortex-a76 ...
set -euo pipefail

root="$(realpath -m "${1:-${KILN_HOME:-$HOME/.cache/kiln}/aarch64-python}")"
dest="$root/runtime-packages"
host_python="${PYTHON:-python3}"
wheels=(safetensors==0.8.0 tokenizers==0.23.3 jinja2==3.1.6 markupsafe==3.0.4 ml_dtypes==0.7.0)
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
        unzip -q "$wheel" -d "$build"
    done
    (cd "$build/downloads" && sha256sum -- *.whl) >"$build/SHA256SUMS"
    rm -rf "$build/downloads"

    # .pyc: PYTHONDONTWRITEBYTECODE may be set, and imports under emulation are slow without them
    "$root/run" -m compileall -q -j0 -x '/(tests?|testing)/' "$build" >/dev/null
    echo "$spec" >"$build/.spec"
    rm -rf "$dest"  # has .spec: made by this script
    chmod 755 "$build"
    mv "$build" "$dest"
    echo "built $dest in $((SECONDS - start))s ($(du -sh "$dest" | cut -f1))"
fi

PYTHONPATH="$dest" "$root/run" -c '
import safetensors, tokenizers, jinja2, ml_dtypes
print("tokenizers", tokenizers.__version__, "ml_dtypes", ml_dtypes.__version__)
'
