"""An image encoder compiled by TVM for a CPU: `encode_image.so` and its description beside it, and
the runner that calls it on one image's inputs (rows padded to a multiple of 4).

    compile_encoder(graph, Target("cpu"), folder)
    rows = TVMImageEncoder(folder, weights).encode(encoder_inputs(pixel_values, patch, row_block=4))

The weights are the graph's params by IR name, laid out here as each kernel reads them (layouts.py).
An artifact holds it beside a vision-language model's step code (compiler/codegen.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.backends.base import BackendError, CompiledCode
from kiln.backends.targets import Target
from kiln.ir import Graph
from kiln.ir.host_arrays import as_numpy

LIBRARY = "encode_image.so"
DESCRIPTION = "encode_image.json"
ROW_BLOCK = 4
CPU_DEVICE = 1  # DLPack's kDLCPU
CUDA_DEVICE = 2  # kDLCUDA


def compile_encoder(
    graph: Graph, target: Target, folder: Path, num_threads: int | None = None
) -> CompiledCode:
    from kiln.backends.tvm import cpu
    from kiln.backends.tvm.lowering import ENCODE_IMAGE, lower_encoder

    folder.mkdir(parents=True, exist_ok=True)
    if target.kind == "cuda":
        return _compile_cuda_encoder(graph, target, folder)
    llvm = cpu.llvm_target(target, num_threads)
    lowered = lower_encoder(graph, "cpu", cpu.schedule_cpu)
    cpu.export(cpu.build_cpu(lowered.module, llvm), str(folder / LIBRARY), target)
    description = {
        "function": ENCODE_IMAGE,
        "inputs": [value.name for value in graph.inputs],
        "padded": [value.name for value in graph.inputs if value.type.shape[:1] == ("T",)],
        "params": [spec.to_dict() for spec in lowered.params],
    }
    (folder / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    from kiln.backends.tvm.layouts import stored_weights

    return CompiledCode(
        [LIBRARY, DESCRIPTION], dict(lowered.kernel_origins), {}, stored_weights(description["params"])
    )


def _compile_cuda_encoder(graph: Graph, target: Target, folder: Path) -> CompiledCode:
    """Cross-compiled for the target's sm_XX as the step is (backends/tvm/cuda.py), in a child process."""
    from kiln.backends.tvm.cuda import check_cuda_library, run_build
    from kiln.backends.tvm.layouts import stored_weights
    from kiln.backends.tvm.lowering import ENCODE_IMAGE
    from kiln.ir import Program

    result = run_build(Program(graph, {}), target, folder, ptx=True, entry=ENCODE_IMAGE, library=LIBRARY)
    device_code = check_cuda_library(folder / LIBRARY, target)
    description = {
        "function": ENCODE_IMAGE,
        "device": "cuda",
        "gpu_arch": target.gpu_arch,
        "inputs": [value.name for value in graph.inputs],
        "padded": [value.name for value in graph.inputs if value.type.shape[:1] == ("T",)],
        "params": result["params"],
    }
    (folder / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    manifest = {"device_code": device_code}
    return CompiledCode(
        [LIBRARY, DESCRIPTION], dict(result["kernels"]), manifest, stored_weights(result["params"])
    )


class TVMImageEncoder:
    def __init__(self, folder: Path, weights: Mapping[str, Any]) -> None:
        from kiln.backends.tvm.executable import host_aligned, load_runtime

        description = json.loads((folder / DESCRIPTION).read_text())
        self.device = description.get("device", "cpu")
        self.ffi = load_runtime()
        vm = self.ffi.load_module(str(folder / LIBRARY))["vm_load_executable"]()
        if self.device == "cpu":
            vm["vm_initialization"](CPU_DEVICE, 0, 2)
        else:  # device code on the GPU, the VM's host code on the CPU, as the step's
            vm["vm_initialization"](CUDA_DEVICE, 0, 2, CPU_DEVICE, 0, 2)
        self.function = vm[description["function"]]
        self.input_names: list[str] = description["inputs"]
        self.padded = set(description["padded"])  # passed as [rows / 4, 4, ...]
        self._weights = [
            self._placed(host_aligned(_laid_out(spec, weights))) for spec in description["params"]
        ]
        self._weight_args = [self.ffi.from_dlpack(w) for w in self._weights]

    def _placed(self, array: npt.NDArray[Any]) -> Any:
        """`array` where the compiled code reads it: as it is on a CPU, a torch tensor on the GPU."""
        if self.device == "cpu":
            return array
        import torch

        return torch.from_numpy(array).to(self.device)

    def encode(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
        """The encoder's output rows for `inputs` (by name; rows a multiple of 4, padding included)."""
        from kiln.backends.tvm.executable import host_aligned

        rows = inputs[self.input_names[0]].shape[0]
        if rows % ROW_BLOCK:
            raise BackendError(f"tvm: the encoder takes rows in blocks of {ROW_BLOCK}, got {rows}")
        arrays = []
        for name in self.input_names:
            array = np.ascontiguousarray(inputs[name])
            if name in self.padded:
                array = array.reshape(rows // ROW_BLOCK, ROW_BLOCK, *array.shape[1:])
            arrays.append(self._placed(host_aligned(array)))
        arrays.append(self._placed(np.array([rows, rows], dtype=np.int64)))  # row_counts, as the step's
        args = [self.ffi.from_dlpack(a) for a in arrays]
        rows_out = self.function(*args, *self._weight_args)
        if self.device == "cpu":
            return np.from_dlpack(rows_out).copy()
        import torch

        return torch.from_dlpack(rows_out).cpu().numpy()


def _laid_out(spec: dict[str, Any], weights: Mapping[str, Any]) -> npt.NDArray[Any]:
    """A parameter as the kernel reads it: stored so in an artifact (by its stored name), else laid out
    here from the graph's weight."""
    from kiln.backends.tvm.abi import stored_name

    stored = weights.get(stored_name(spec["source"], spec["transform"]))
    if isinstance(stored, np.ndarray):  # an artifact's (mapped) weights file
        return np.ascontiguousarray(stored)
    from kiln.backends.tvm.layouts import apply_layout

    return as_numpy(apply_layout(spec["transform"], weights[spec["source"]]).contiguous())
