"""The TensorRT backend: the same ONNX lowering (standard ops only: TensorRT's parser has no
com.microsoft ops), then an engine built on a machine with a GPU of the target's arch.

Where this machine has no such GPU, compile writes and checks the ONNX model and raises
DeviceRequiredError: `kiln compile` keeps the folder and exits 2, for a GPU builder to finish.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.backends.base import (
    BackendError,
    Capabilities,
    CompiledCode,
    CompileSettings,
    DeviceRequiredError,
    Executable,
    ImageEncoder,
    StoredWeight,
)
from kiln.backends.onnx import LoweringOptions, check_model, lower_program, read_lowered, write_lowered
from kiln.backends.onnx.capabilities import onnx_capabilities
from kiln.backends.signature_record import read_signature, signature_record
from kiln.backends.targets import Target, mismatch
from kiln.ir import Program


def _tensorrt_version() -> str | None:
    try:
        import tensorrt as trt
    except ImportError:
        return None
    return str(trt.__version__)


class TensorRTBackend:
    name = "tensorrt"
    copies_weights = True

    def version(self) -> str:
        found = _tensorrt_version()
        return f"tensorrt-{found}" if found else "tensorrt-unavailable"

    def capabilities(self, target: Target) -> Capabilities:
        unavailable = None
        if target.kind != "cuda":
            unavailable = f"TensorRT needs an NVIDIA GPU target (cuda:sm_XX), not {target.name}"
        return onnx_capabilities(self.name, target, unavailable)

    def compile(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        lowered = lower_program(program, LoweringOptions(contrib_ops=False))
        checks = check_model(lowered.model)
        files = write_lowered(lowered, folder, {**signature_record(program.graph), "checks": checks})
        reason = mismatch(target)
        if reason is not None:
            raise DeviceRequiredError(
                f"cannot build the TensorRT engine for {target.name}: {reason}; wrote and checked the ONNX "
                f"model ({checks[0]})",
                written=[f"{target.folder}/{name}" for name in files],
                hint=f"run this `kiln compile` where there is an NVIDIA {target.gpu_arch} GPU and tensorrt",
            )
        from kiln.backends.tensorrt.engine import build_engine, with_initializers  # not exercised here

        built = build_engine(with_initializers(lowered, program.weights), folder, settings)
        meta_path = folder / "onnx.json"
        meta = json.loads(meta_path.read_text())
        meta["engine"] = built
        meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        return CompiledCode(
            [*files, built["engine"]], dict.fromkeys(lowered.kernels, "tensorrt"), {"tensorrt": built}
        )

    def check_structure(self, folder: Path, target: Target) -> list[str]:
        model, meta = read_lowered(folder)
        lines = check_model(model)
        engine = meta.get("engine", {}).get("engine")
        if engine is None or not (folder / engine).is_file():
            raise BackendError(
                f"{folder}: no TensorRT engine", hint="compile on a machine with the target's GPU"
            )
        return [*lines, f"{engine} present ({(folder / engine).stat().st_size:,} bytes)"]

    def compile_encoder(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        raise BackendError(
            "tensorrt: image encoders are not built by this backend yet",
            hint="compile the vision-language model with --backend tvm or --backend onnxruntime",
        )

    def load_encoder(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> ImageEncoder:
        raise BackendError("tensorrt: image encoders are not built by this backend yet")

    def stored_weights(self, folder: Path) -> list[StoredWeight] | None:
        return None  # the program's weights as they are

    def load(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> Executable:
        reason = mismatch(target)
        if reason is not None:
            raise BackendError(f"cannot run the TensorRT engine: {reason}")
        _, meta = read_lowered(folder)
        engine = meta.get("engine", {}).get("engine")
        if engine is None:
            raise BackendError(
                f"{folder}: no TensorRT engine", hint="compile on a machine with the target's GPU"
            )
        from kiln.backends.tensorrt.executable import TensorRTExecutable  # not exercised here

        return TensorRTExecutable(folder / engine, meta, read_signature(meta, folder))
