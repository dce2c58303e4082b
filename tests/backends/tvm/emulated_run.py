"""Call compiled TVM functions with numpy, tvm_ffi and libtvm_runtime.so alone.

Run by the aarch64 tests under qemu-aarch64 with Debian's arm64 Python (no torch, no kiln, no TVM
compiler): `python emulated_run.py TVM_LIB_DIR JOBS.json`. Each job names a `library` (.so), a
`function`, an `inputs` .npz of `arg_0`, `arg_1`, ... (0-d arrays go in as Python ints), whether the
library is a Relax VM executable (`vm`: call `function` of the VM on the CPU), and an `output` .npy
that gets the returned tensor, or argument `result_arg` after the call (an output written in place).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from typing import Any

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


def run(job: dict[str, Any]) -> None:
    module = tvm_ffi.load_module(job["library"])
    if job.get("vm"):
        vm = module["vm_load_executable"]()
        vm["vm_initialization"](CPU, 0, POOLED_ALLOCATOR)
        function = vm[job["function"]]
    else:
        function = module[job["function"]]
    arrays = np.load(job["inputs"])
    args = [arrays[f"arg_{i}"] for i in range(len(arrays.files))]
    tensors = [int(a) if a.ndim == 0 else aligned(a) for a in args]
    returned = function(*[t if isinstance(t, int) else tvm_ffi.from_dlpack(t) for t in tensors])
    result = np.from_dlpack(returned) if job.get("result_arg") is None else tensors[job["result_arg"]]
    np.save(job["output"], np.array(result, copy=True))


def main(library_dir: str, jobs_file: str) -> None:
    ctypes.CDLL(str(Path(library_dir) / "libtvm_runtime.so"), ctypes.RTLD_GLOBAL)
    for job in json.loads(Path(jobs_file).read_text()):
        run(job)
        print(f"{Path(job['library']).name} {job['function']}: done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
