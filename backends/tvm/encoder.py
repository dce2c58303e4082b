"""An image encoder compiled by TVM for a CPU: `encode_image.so` and its description beside it, and
the runner that calls it on one image's inputs (rows padded to a multiple of 4).

    compile_encoder(graph, Target("cpu"), folder)
    rows = TVMImageEncoder(folder, weights).encode(encoder_inputs(pixel_values, patch, row_block=4))

The weights are the graph's params by IR name, laid out here as each kernel reads them (layouts.py).
Not yet part of an artifact or a backend's compile (issue 42): the encoder is compiled and run on its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.backends.base import BackendError
from kiln.backends.targets import Target
from kiln.ir import Graph
from kiln.ir.host_arrays import as_numpy

LIBRARY = "encode_image.so"
DESCRIPTION = "encode_image.json"
ROW_BLOCK = 4
CPU_DEVICE = 1  # DLPack's kDLCPU


def compile_encoder(graph: Graph, target: Target, folder: Path, num_threads: int | None = None) -> None:
    from kiln.backends.tvm import cpu
    from kiln.backends.tvm.lowering import ENCODE_IMAGE, lower_encoder

    if target.kind != "cpu":
        raise BackendError(f"tvm: the image encoder compiles for CPU targets only so far, not {target.name}")
    folder.mkdir(parents=True, exist_ok=True)
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


class TVMImageEncoder:
    def __init__(self, folder: Path, weights: Mapping[str, torch.Tensor]) -> None:
        from kiln.backends.tvm.executable import host_aligned, load_runtime
        from kiln.backends.tvm.layouts import apply_layout

        description = json.loads((folder / DESCRIPTION).read_text())
        self.ffi = load_runtime()
        vm = self.ffi.load_module(str(folder / LIBRARY))["vm_load_executable"]()
        vm["vm_initialization"](CPU_DEVICE, 0, 2)
        self.function = vm[description["function"]]
        self.input_names: list[str] = description["inputs"]
        self.padded = set(description["padded"])  # passed as [rows / 4, 4, ...]
        self._weights = [
            host_aligned(as_numpy(apply_layout(spec["transform"], weights[spec["source"]]).contiguous()))
            for spec in description["params"]
        ]
        self._weight_args = [self.ffi.from_dlpack(w) for w in self._weights]

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
            arrays.append(host_aligned(array))
        arrays.append(np.array([rows, rows], dtype=np.int64))  # row_counts, as the step's
        args = [self.ffi.from_dlpack(a) for a in arrays]
        return np.from_dlpack(self.function(*args, *self._weight_args)).copy()
