#!/usr/bin/env bash
# On a GPU machine: check kiln's CUDA builds of SmolLM2-135M (seeded random weights: float32 with and
# without CUDA graphs, int4, and a float8 KV cache) against the reference interpreter, and time decode at batch 1, 16, 64;
# then a Llama-3-8B-shaped float16 build (weights made on the GPU): step vs decode kernels agree,
# prefill tokens/s, decode tokens/s at batch 1, 16, 64 against the HBM floor.
#
#   here (no GPU):   .venv/bin/python scripts/gpu_bundle.py bundle /tmp/kiln-gpu-bundle   (~2 min, ~5.5 MB)
#   on the GPU box:  scripts/gpu_check.sh /tmp/kiln-gpu-bundle
#
# Needs on the GPU box: this repo, python with torch (CUDA), apache-tvm==0.27.0.post1 and
# apache-tvm-ffi==0.1.14.post1 (installed here if missing and pip can reach an index), an NVIDIA driver
# for CUDA 13 and libcudart.so.13 (from a CUDA 13 toolkit or `pip install nvidia-cuda-runtime`).
set -euo pipefail

BUNDLE="${1:?usage: scripts/gpu_check.sh BUNDLE_DIR}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then  # PYTHON=... wins; else the repo's .venv, else python3
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

die() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

[ -f "$BUNDLE/bundle.json" ] || die "$BUNDLE/bundle.json not found (make the bundle with scripts/gpu_bundle.py bundle)"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || die "nvidia-smi failed"

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || die "$PYTHON: torch is missing or sees no GPU"

if ! "$PYTHON" -c "import tvm_ffi, importlib.metadata as m; assert m.version('apache-tvm') == '0.27.0.post1'" 2>/dev/null; then
  echo "gpu_check: installing apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1"
  "$PYTHON" -m pip install -q apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1 \
    || die "cannot pip install the TVM runtime (offline?); install the two wheels by hand"
fi

# kiln is the repo folder itself (pyproject maps the package to the repo root)
if ! "$PYTHON" -c "import kiln" 2>/dev/null; then
  [ "$(basename "$REPO")" = kiln ] || die "kiln is not importable: pip install -e $REPO, or check the repo out as a folder named kiln"
  export PYTHONPATH="$(dirname "$REPO")${PYTHONPATH:+:$PYTHONPATH}"
fi

# libcudart.so.13 for libtvm_runtime_cuda.so: a CUDA 13 toolkit, or the pip nvidia runtime wheel
CUDART_DIRS="$("$PYTHON" - <<'PY'
import glob, os, site
dirs = set()
for root in site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/local/cuda-13.0/lib64", "/usr/local/cuda-13.0/lib"]:
    for path in glob.glob(os.path.join(root, "**", "libcudart.so.13*"), recursive=True):
        dirs.add(os.path.dirname(path))
print(":".join(sorted(dirs)))
PY
)"
[ -n "$CUDART_DIRS" ] || ldconfig -p | grep -q "libcudart.so.13" \
  || die "libcudart.so.13 not found: install a CUDA 13 toolkit or pip install nvidia-cuda-runtime (CUDA 13)"
export LD_LIBRARY_PATH="${CUDART_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cd "$REPO"
exec "$PYTHON" scripts/gpu_bundle.py check "$BUNDLE"
