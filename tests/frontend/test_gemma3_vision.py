"""Gemma 3's image encoder (SigLIP, pooling, norm, projection) captured into Kiln IR: the interpreter
against transformers' Gemma3ForConditionalGeneration, and ONNX Runtime against the interpreter, on
random weights (TVM's compile of it is checked on the whole model that test_vision_gguf.py serves)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln.frontend.capture import capture_module
from kiln.frontend.models.gemma3_vision import (
    Gemma3VisionConfig,
    Gemma3VisionProjector,
    encoder_inputs,
    from_gemma3_weights,
    input_types,
)
from kiln.ir import Program
from kiln.ir.interpreter import interpret

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_gemma3) -> Path:
    folder = tmp_path_factory.mktemp("gemma3")
    tiny_gemma3(folder)
    return folder


def _captured(folder: Path) -> tuple[Gemma3VisionConfig, Program]:
    config = Gemma3VisionConfig.from_gemma3(json.loads((folder / "config.json").read_text()))
    return _program(config, load_file(folder / "model.safetensors"))


def _program(
    config: Gemma3VisionConfig, tensors: dict[str, torch.Tensor]
) -> tuple[Gemma3VisionConfig, Program]:
    module = Gemma3VisionProjector(config)
    module.load_state_dict(from_gemma3_weights(config, tensors), strict=True)
    graph = capture_module(module.eval(), input_types(config), "encode_image")
    return config, Program(graph, {p.name: module.get_parameter(p.name).detach() for p in graph.params})


def _saved_as_transformers_4(gemma3_dir: Path, folder: Path) -> Path:
    """The tiny model as llama.cpp's converter reads it: transformers 4's tensor names, an image
    processor config with the image's token count."""
    import shutil

    from safetensors.torch import save_file
    from transformers import Gemma3ImageProcessorPil

    hf = folder / "hf"
    shutil.copytree(gemma3_dir, hf)
    weights = load_file(hf / "model.safetensors")
    older = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in weights.items()}
    save_file(older, hf / "model.safetensors", metadata={"format": "pt"})
    processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).to_dict()
    (hf / "preprocessor_config.json").write_text(json.dumps(processor | {"image_seq_length": 16}))
    return hf


@pytest.mark.parametrize("source", ["checkpoint", "llama.cpp mmproj"])
def test_the_captured_encoder_matches_transformers(
    gemma3_dir: Path, tmp_path: Path, source: str, request: pytest.FixtureRequest
) -> None:
    from transformers import Gemma3ForConditionalGeneration

    if source == "checkpoint":
        config, program = _captured(gemma3_dir)
    else:
        from kiln.frontend.mmproj import read_mmproj

        convert = request.getfixturevalue("llama_cpp_mmproj")
        encoder = read_mmproj(
            convert(_saved_as_transformers_4(gemma3_dir, tmp_path), tmp_path / "mmproj.gguf")
        )
        assert encoder.kind == "gemma3"
        config, program = _program(Gemma3VisionConfig.from_gemma3(encoder.config), encoder.tensors)
    reference = Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir).eval()
    pixel_values = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.model.get_image_features(pixel_values=pixel_values).pooler_output
    for image, want in zip(pixel_values, expected, strict=True):
        (got,) = interpret(program.graph, program.weights, encoder_inputs(image.numpy(), config.patch_size))
        assert got.shape == (config.tokens_per_image, 48) == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("backend", ["onnxruntime"])  # TVM's: test_vision_gguf.py, on the served artifact
def test_the_compiled_encoder_matches_the_interpreter(
    gemma3_dir: Path, tmp_path: Path, backend: str, compile_image_encoder
) -> None:
    config, program = _captured(gemma3_dir)
    encoder = compile_image_encoder(program, backend, tmp_path)
    pixels = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(2)).numpy()
    inputs = encoder_inputs(pixels, config.patch_size)
    (expected,) = interpret(program.graph, program.weights, inputs)
    got = encoder.encode(inputs)
    assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(np.abs(got - expected.numpy()).max())
