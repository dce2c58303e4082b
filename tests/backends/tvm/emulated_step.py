"""Run one `step` of a TVM artifact folder with numpy, tvm_ffi and libtvm_runtime.so alone.

Run by test_aarch64.py under qemu-aarch64 with Debian's arm64 Python (no torch, no kiln, no TVM
compiler): `python emulated_step.py TVM_LIB_DIR STEP_SO INPUTS.npz OUT.npy`. INPUTS.npz holds
`input_0`.. (the step's tensors before the KV cache, rows padded as TVMExecutable pads them),
`kv_cache`, `row_counts` and `weight_0`.. (laid out as step.json says); OUT.npy gets the logits.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import tvm_ffi

CPU = 1  # DLPack device type
POOLED_ALLOCATOR = 2
ALIGNMENT = 64  # the compiled kernels' aligned vector loads


def aligned(array: np.ndarray) -> np.ndarray:
    buffer = np.empty(array.nbytes + ALIGNMENT, dtype=np.uint8)
    start = -buffer.ctypes.data % ALIGNMENT
    copy = buffer[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def main(library_dir: str, step_so: str, inputs_file: str, out_file: str) -> None:
    ctypes.CDLL(str(Path(library_dir) / "libtvm_runtime.so"), ctypes.RTLD_GLOBAL)
    module = tvm_ffi.load_module(step_so)
    vm = module["vm_load_executable"]()
    vm["vm_initialization"](CPU, 0, POOLED_ALLOCATOR)
    arrays = np.load(inputs_file)
    inputs = [arrays[f"input_{i}"] for i in range(sum(name.startswith("input_") for name in arrays.files))]
    weights = [arrays[f"weight_{i}"] for i in range(sum(name.startswith("weight_") for name in arrays.files))]
    tensors = [aligned(a) for a in [*inputs, arrays["kv_cache"], arrays["row_counts"], *weights]]
    logits = vm["step"](*[tvm_ffi.from_dlpack(a) for a in tensors])
    np.save(out_file, np.from_dlpack(logits).copy())
    print(f"{Path(step_so).name}: {len(weights)} weights, logits {list(np.from_dlpack(logits).shape)}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
