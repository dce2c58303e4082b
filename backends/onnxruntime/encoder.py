"""An image encoder as an ONNX model run by ONNX Runtime on the CPU: `encode_image.onnx` and its weight
bindings beside it, and the runner that calls it on one image's inputs.

    compile_encoder(Program(graph, weights), folder)
    rows = OrtImageEncoder(folder, weights).encode(encoder_inputs(pixel_values, patch))

An artifact holds it beside a vision-language model's step code (compiler/codegen.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.backends.base import CompiledCode
from kiln.backends.onnx.lower import lower_program
from kiln.backends.onnx.weights import WeightBinding, materialize
from kiln.ir import Program
from kiln.ir.host_arrays import as_numpy

MODEL = "encode_image.onnx"
BINDINGS = "encode_image.json"


def compile_encoder(program: Program, folder: Path) -> CompiledCode:
    folder.mkdir(parents=True, exist_ok=True)
    lowered = lower_program(program)
    (folder / MODEL).write_bytes(lowered.model.SerializeToString())
    (folder / BINDINGS).write_text(json.dumps(lowered.meta(), indent=1) + "\n")
    return CompiledCode([MODEL, BINDINGS], {"all ops": "onnxruntime"})


class OrtImageEncoder:
    def __init__(
        self, folder: Path, weights: Mapping[str, torch.Tensor], num_threads: int | None = None
    ) -> None:
        import onnxruntime as ort

        from kiln.backends.onnxruntime.session import session_options

        meta = json.loads((folder / BINDINGS).read_text())
        options = session_options({"intra_op_num_threads": num_threads or 0})
        self.session = ort.InferenceSession(str(folder / MODEL), options, providers=["CPUExecutionProvider"])
        bindings = [WeightBinding.from_json(b) for b in meta["bindings"]]
        self._weights = {b.name: as_numpy(materialize(b, dict(weights)).contiguous()) for b in bindings}
        self._output = meta["outputs"][0]

    def encode(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
        feeds = {name: np.ascontiguousarray(array) for name, array in inputs.items()} | self._weights
        (rows,) = self.session.run([self._output], feeds)
        return rows
