"""Build a TensorRT engine from the lowered ONNX model with the TensorRT Python API.

NOT EXERCISED: written without a GPU or the tensorrt package on the development machine; the backend
only calls it where `mismatch(target)` says this machine has an NVIDIA GPU of the target's arch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import onnx
import torch

from kiln.backends.base import BackendError, CompileSettings
from kiln.backends.onnx import LoweredModel, materialize

ENGINE_FILE = "model.plan"
BLOCK_SIZE = 16  # the runtime's block size; the engine's profile fixes the cache's BS dim to it


MAX_CACHE_BLOCKS = 1 << 20  # the profile's largest KV cache: 16M tokens at 16 a block


def initializer(name: str, tensor: torch.Tensor) -> onnx.TensorProto:
    """A weight as an ONNX initializer; bfloat16 goes as its raw bits (numpy has no bfloat16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype != torch.bfloat16:
        return onnx.numpy_helper.from_array(tensor.numpy(), name)
    bits = tensor.view(torch.int16).numpy().tobytes()
    return onnx.helper.make_tensor(name, onnx.TensorProto.BFLOAT16, list(tensor.shape), bits, raw=True)


def with_initializers(lowered: LoweredModel, weights: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """The model with its weight inputs made initializers (TensorRT folds and refits initializers
    only)."""
    model = onnx.ModelProto()
    model.CopyFrom(lowered.model)
    names = {b.name for b in lowered.bindings}
    kept = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    for binding in lowered.bindings:
        model.graph.initializer.append(initializer(binding.name, materialize(binding, weights)))
    return model


def write_for_parser(model: onnx.ModelProto, folder: Path) -> Path:
    """model.onnx in `folder` with the weights beside it in weights.bin (ONNX external data), so a
    model over protobuf's 2 GB limit parses (`OnnxParser.parse_from_file`). Consumes `model`'s data."""
    path = folder / "model.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin"
    )
    return path


def _profile_shapes(settings: CompileSettings) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each symbolic dim, from the artifact's limits: tuned for max_num_seqs
    sequences of max_model_len tokens, any KV cache from 2 blocks (the null block and one) up to
    MAX_CACHE_BLOCKS, which the engine may size as memory allows."""
    max_tokens = max(settings.max_model_len, settings.max_num_seqs)
    max_blocks = -(-settings.max_model_len // BLOCK_SIZE)
    seqs = settings.max_num_seqs
    cache_blocks = min(seqs * max_blocks + 1, MAX_CACHE_BLOCKS)
    return {
        "T": (1, min(256, max_tokens), max_tokens),
        "B": (1, max(1, seqs // 2), seqs),
        "B1": (2, max(1, seqs // 2) + 1, seqs + 1),
        "MB": (1, max(1, max_blocks // 4), max_blocks),
        "L": (0, max(1, seqs // 2), max(seqs, max_tokens)),
        "NB": (2, cache_blocks, MAX_CACHE_BLOCKS),
        "BS": (BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE),
    }


def build_engine(
    model: onnx.ModelProto, folder: Path, settings: CompileSettings, fp16: bool = True
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
    with tempfile.TemporaryDirectory(prefix="kiln-trt-") as scratch:
        parsed = parser.parse_from_file(str(write_for_parser(model, Path(scratch))))
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendError(f"TensorRT cannot parse the lowered ONNX model: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    dims = _profile_shapes(settings)
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
