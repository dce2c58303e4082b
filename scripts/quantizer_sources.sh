#!/usr/bin/env bash
# Fetch the GPTQ and AWQ tools' own Python source from PyPI (checked by sha256) and unpack it: the tests
# make GPTQ and AWQ checkpoints with them (tests/frontend/checkpoints.py). Never installed, never imported by
# kiln: the tests load the packing and quantizing modules they need from these folders.
#
#   scripts/quantizer_sources.sh [DEST]
#       -> DEST/auto_gptq-0.7.1 (auto-gptq's wheel, unzipped) and DEST/autoawq-0.2.9 (AutoAWQ's sdist)
#
# DEST defaults to $KILN_HOME/quantizer-sources (KILN_HOME defaults to ~/.cache/kiln). A rerun reuses
# what is there.
set -euo pipefail
dest=${1:-${KILN_HOME:-$HOME/.cache/kiln}/quantizer-sources}
mkdir -p "$dest"
dest=$(realpath "$dest")
python=${PYTHON:-python3}

fetch() {  # fetch NAME==VERSION FILE SHA256 [pip download options...]
  local requirement=$1 file=$2 sha256=$3
  shift 3
  if [ ! -f "$dest/$file" ]; then
    "$python" -m pip download --quiet --no-deps "$@" "$requirement" -d "$dest"
  fi
  echo "$sha256  $dest/$file" | sha256sum --check --quiet - || {
    echo "error: $dest/$file does not have the pinned sha256 $sha256: delete it and rerun" >&2
    exit 1
  }
}

# auto-gptq ships wheels only; its Python files are the same in each (the CUDA extensions are not used)
gptq_wheel=auto_gptq-0.7.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
fetch auto-gptq==0.7.1 "$gptq_wheel" a372d81d523b8d2f98639bbca63c0c427cab0ed55b8a57bb96706b0942aa01c9 \
  --only-binary :all: --python-version 3.11 --implementation cp --abi cp311 --platform manylinux2014_x86_64
if [ ! -f "$dest/auto_gptq-0.7.1/auto_gptq/quantization/gptq.py" ]; then
  "$python" -m zipfile -e "$dest/$gptq_wheel" "$dest/auto_gptq-0.7.1"
fi

fetch autoawq==0.2.9 autoawq-0.2.9.tar.gz f3397687118c7d23c769de0de05ff1dca8950a2644acbe1b6eb1399c691fe7ee \
  --no-binary :all:
if [ ! -f "$dest/autoawq-0.2.9/awq/quantize/quantizer.py" ]; then
  tar -xzf "$dest/autoawq-0.2.9.tar.gz" -C "$dest"
fi
echo "$dest"
