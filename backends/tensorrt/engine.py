"""Build a TensorRT engine from the lowered ONNX model with the TensorRT Python API.

NOT EXERCISED: written without a GPU or the tensorrt package on the development machine; the backend
only calls it where `mismatch(target)` says this machine has an NVIDIA GPU of the target's arch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import torch

from kiln.backends.base import BackendError, CompileSettings
from kiln.backends.onnx import LoweredModel, materialize

ENGINE_FILE = "model.plan"
BLOCK_SIZE = 16  # the runtime's block size; the engine's profile fixes the cache's BS dim to it


def with_initializers(lowered: LoweredModel, weights: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """The model with its weight inputs made initializers (TensorRT folds and refits initializers
    only). Held in memory: for models over 2 GB this needs ONNX external data instead."""
    model = onnx.ModelProto()
    model.CopyFrom(lowered.model)
    names = {b.name for b in lowered.bindings}
    kept = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for binding in lowered.bindings:
        tensor = materialize(binding, weights)
        model.graph.initializer.append(onnx.numpy_helper.from_array(tensor.numpy(), binding.name))
    return model


def _profile_shapes(settings: CompileSettings, num_blocks: int) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each symbolic dim."""
    max_tokens = max(settings.max_model_len, settings.max_num_seqs)
    max_blocks = -(-settings.max_model_len // BLOCK_SIZE)
    seqs = settings.max_num_seqs
    return {
        "T": (1, min(256, max_tokens), max_tokens),
        "B": (1, max(1, seqs // 2), seqs),
        "B1": (2, max(1, seqs // 2) + 1, seqs + 1),
        "MB": (1, max(1, max_blocks // 4), max_blocks),
        "L": (0, max(1, seqs // 2), max(seqs, max_tokens)),
        "NB": (1, num_blocks, num_blocks),
        "BS": (BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE),
    }


def build_engine(
    model: onnx.ModelProto, folder: Path, settings: CompileSettings, num_blocks: int, fp16: bool = True
) -> dict[str, Any]:
    """Parse, build and write model.plan; the manifest fields describing the build."""
    try:
        import tensorrt as trt  # imported here: most machines running kiln have no TensorRT
    except ImportError as error:
        raise BackendError(
            f"tensorrt is not importable here ({error})", hint="pip install tensorrt on the GPU builder"
        ) from None
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendError(f"TensorRT cannot parse the lowered ONNX model: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    dims = _profile_shapes(settings, num_blocks)
    profile = builder.create_optimization_profile()
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        shapes = [[], [], []]
        for dim, info in zip(tensor.shape, _input_dims(model, tensor.name), strict=True):
            for which in range(3):
                shapes[which].append(dims[info][which] if isinstance(info, str) else dim)
        profile.set_shape(tensor.name, *shapes)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BackendError("TensorRT failed to build the engine (see its log above)")
    (folder / ENGINE_FILE).write_bytes(bytes(serialized))
    return {"engine": ENGINE_FILE, "fp16": fp16, "profile": {k: list(v) for k, v in dims.items()}}


def _input_dims(model: onnx.ModelProto, name: str) -> list[int | str]:
    for info in model.graph.input:
        if info.name == name:
            return [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]
    raise BackendError(f"the engine has an input {name} the ONNX model lacks")
