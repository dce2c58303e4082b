#!/usr/bin/env bash
# CUDA 12's NVRTC with CUDA 12 headers, from PyPI, for the GPUs CUDA 13 dropped (cuda:sm_70 V100,
# cuda:sm_72 Jetson Xavier): scripts/cuda12_nvrtc.sh [FOLDER]
# FOLDER (default ${KILN_HOME:-$HOME/.cache/kiln}/cuda12-nvrtc) gets site/ (cuda-bindings 12, libnvrtc.so.12)
# and include/ (cuda_runtime, cuda_fp16, libcu++). kiln finds it there, or at $KILN_CUDA12_NVRTC.
set -euo pipefail

root="$(realpath -m "${1:-${KILN_HOME:-$HOME/.cache/kiln}/cuda12-nvrtc}")"
host_python="${PYTHON:-python3}"
packages=(
    cuda-bindings==12.9.4 cuda-pathfinder==1.3.3 nvidia-cuda-nvrtc-cu12==12.9.86
    nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27
)
spec="${packages[*]}"

if [[ "$(cat "$root/.spec" 2>/dev/null)" == "$spec" ]]; then
    echo "$root: up to date"
    exit 0
fi
if [[ -e "$root" && ! -f "$root/.spec" && -n "$(ls -A "$root")" ]]; then
    echo "$root is not empty and not made by this script; not replacing it" >&2
    exit 1
fi
build="$root.partial"
rm -rf "$build"
mkdir -p "$build/downloads" "$build/include"
"$host_python" -m pip download --quiet --no-deps --only-binary=:all: -d "$build/downloads" "${packages[@]}"
(cd "$build/downloads" && sha256sum -- *.whl) >"$build/SHA256SUMS"
"$host_python" -m pip install --quiet --no-deps --no-index --target "$build/site" "$build"/downloads/*.whl
cp -r "$build"/site/nvidia/cuda_runtime/include/. "$build"/site/nvidia/cuda_cccl/include/. "$build/include/"
rm -rf "$build/downloads"
echo "$spec" >"$build/.spec"
rm -rf "$root"
mv "$build" "$root"
echo "$root: $(du -sh "$root" | cut -f1)"
