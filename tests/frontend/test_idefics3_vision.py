"""Idefics3's (SmolVLM's) image encoder (SigLIP, pixel shuffle, connector) captured into Kiln IR: the
interpreter against transformers' Idefics3ForConditionalGeneration, and ONNX Runtime against the
interpreter, on random weights (TVM's compile of it is checked on the whole model that
test_vision_gguf.py serves)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln.frontend.capture import capture_module
from kiln.frontend.models.idefics3_vision import (
    Idefics3VisionConfig,
    Idefics3VisionProjector,
    encoder_inputs,
    from_idefics3_weights,
    input_types,
)
from kiln.ir import Program
from kiln.ir.interpreter import interpret

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_idefics3) -> Path:
    """The tests' tiny Idefics3 checkpoint (tests/conftest.py `save_tiny_idefics3`), saved once here."""
    folder = tmp_path_factory.mktemp("idefics3")
    tiny_idefics3(folder)
    return folder


def _captured(folder: Path) -> tuple[Idefics3VisionConfig, Program]:
    config = Idefics3VisionConfig.from_idefics3(json.loads((folder / "config.json").read_text()))
    return _program(config, load_file(folder / "model.safetensors"))


def _program(
    config: Idefics3VisionConfig, tensors: dict[str, torch.Tensor]
) -> tuple[Idefics3VisionConfig, Program]:
    module = Idefics3VisionProjector(config)
    module.load_state_dict(from_idefics3_weights(config, tensors), strict=True)
    graph = capture_module(module.eval(), input_types(config), "encode_image")
    state = module.state_dict()
    return config, Program(graph, {p.name: state[p.name].detach() for p in graph.params})


@pytest.mark.parametrize("source", ["checkpoint", "llama.cpp mmproj"])
def test_the_captured_encoder_matches_transformers(
    idefics3_dir: Path, tmp_path: Path, source: str, request: pytest.FixtureRequest
) -> None:
    from transformers import Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil

    if source == "checkpoint":
        config, program = _captured(idefics3_dir)
    else:
        from kiln.frontend.mmproj import read_mmproj

        processor = Idefics3ImageProcessorPil(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
        processor.save_pretrained(idefics3_dir)  # the converter reads the image processor's settings
        convert = request.getfixturevalue("llama_cpp_mmproj")
        encoder = read_mmproj(convert(idefics3_dir, tmp_path / "mmproj.gguf"))
        assert encoder.kind == "idefics3"
        config, program = _program(Idefics3VisionConfig.from_idefics3(encoder.config), encoder.tensors)
    reference = Idefics3ForConditionalGeneration.from_pretrained(idefics3_dir).eval()
    pixel_values = torch.randn(1, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (expected,) = reference.model.get_image_features(pixel_values=pixel_values).pooler_output
    for image, want in zip(pixel_values[0], expected.split(config.num_tokens), strict=True):
        (got,) = interpret(program.graph, program.weights, encoder_inputs(image.numpy(), config.patch_size))
        assert got.shape == (config.num_tokens, 48) == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("backend", ["onnxruntime"])  # TVM's: test_vision_gguf.py, on the served artifact
def test_the_compiled_encoder_matches_the_interpreter(
    idefics3_dir: Path, tmp_path: Path, backend: str, compile_image_encoder
) -> None:
    config, program = _captured(idefics3_dir)
    encoder = compile_image_encoder(program, backend, tmp_path)
    pixels = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(2)).numpy()
    inputs = encoder_inputs(pixels, config.patch_size)
    (expected,) = interpret(program.graph, program.weights, inputs)
    got = encoder.encode(inputs)
    assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(np.abs(got - expected.numpy()).max())
