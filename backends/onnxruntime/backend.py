"""The ONNX Runtime backend: the step lowered to one ONNX model, run on the CPU (or CUDA) EP."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kiln.backends.base import (
    BackendError,
    Capabilities,
    CompiledCode,
    CompileSettings,
    Executable,
    ImageEncoder,
    StoredWeight,
    leave_cores_to_compiled_code,
)
from kiln.backends.onnx.capabilities import onnx_capabilities
from kiln.backends.signature_record import read_signature, signature_record
from kiln.backends.targets import Target
from kiln.ir.host_arrays import torch_weights

if TYPE_CHECKING:
    import torch

    from kiln.ir import Program

SESSION_KEY = "session"


class OnnxRuntimeBackend:
    name = "onnxruntime"
    copies_weights = True

    def version(self) -> str:
        import onnxruntime

        return f"onnxruntime-{onnxruntime.__version__}"

    def capabilities(self, target: Target) -> Capabilities:
        unavailable = None
        if target.kind == "cpu" and target.detail is not None:
            unavailable = (
                f"onnxruntime picks its CPU kernels at run time (MLAS dispatches on the host's ISA); "
                f"target {target.name} names an LLVM mcpu that means nothing to it: use --target cpu"
            )
        return onnx_capabilities(self.name, target, unavailable)

    def compile(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        from kiln.backends.onnx import LoweringOptions, check_model, lower_program, write_lowered
        from kiln.backends.onnxruntime.session import session_config

        lowered = lower_program(program, LoweringOptions(contrib_ops=True))
        checks = check_model(lowered.model)
        config = session_config(target, settings)
        extra = {SESSION_KEY: config, **signature_record(program.graph)}
        files = write_lowered(lowered, folder, {**extra, "checks": checks})
        manifest = {
            "onnx": {
                "opsets": {o.domain or "ai.onnx": o.version for o in lowered.model.opset_import},
                "nodes": len(lowered.model.graph.node),
                "weight_inputs": len(lowered.bindings),
            },
            SESSION_KEY: config,
        }
        return CompiledCode(files, dict(lowered.kernels), manifest)

    def check_structure(self, folder: Path, target: Target) -> list[str]:
        from kiln.backends.onnx import check_model, read_lowered

        model, meta = read_lowered(folder)
        lines = check_model(model)
        for name in meta[SESSION_KEY].get("providers", []):
            lines.append(f"session provider {name[0]} recorded")
        return lines

    def compile_encoder(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        from kiln.backends.onnxruntime.encoder import compile_encoder

        return compile_encoder(program, folder)

    def load_encoder(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> ImageEncoder:
        from kiln.backends.onnxruntime.encoder import OrtImageEncoder

        return OrtImageEncoder(folder, torch_weights(weights))

    def stored_weights(self, folder: Path) -> list[StoredWeight] | None:
        return None  # the program's weights as they are

    def load(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> Executable:
        from kiln.backends.onnx import read_lowered
        from kiln.backends.onnxruntime.executable import OnnxRuntimeExecutable
        from kiln.backends.onnxruntime.session import providers, session_options

        model, meta = read_lowered(folder)
        config = meta.get(SESSION_KEY)
        if config is None:
            raise BackendError(f"{folder}: the ONNX metadata has no session settings")
        if all(name == "CPUExecutionProvider" for name, _ in providers(config)):
            leave_cores_to_compiled_code()
        return OnnxRuntimeExecutable(
            model,
            meta,
            torch_weights(weights),
            session_options(config),
            providers(config),
            read_signature(meta, folder),
        )


__all__ = ["OnnxRuntimeBackend"]
