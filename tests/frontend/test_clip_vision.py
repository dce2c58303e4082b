"""LLaVA-1.5's image encoder (CLIP tower + projector) captured into Kiln IR and run by the reference
interpreter, against transformers' LlavaForConditionalGeneration on the same random weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln.frontend.capture import capture_module
from kiln.frontend.models.clip_vision import (
    ClipVisionConfig,
    ClipVisionProjector,
    encoder_inputs,
    from_llava_weights,
    input_types,
)
from kiln.ir.interpreter import interpret

transformers = pytest.importorskip("transformers")


def _tiny_llava(folder: Path, strategy: str = "default", feature_layer: int = -2) -> Path:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        image_size=28,
        patch_size=7,
    )
    text = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=299,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms and biases too, so a wrong mapping shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                parameter.normal_(0, 0.5 if "bias" in name or "embedding" in name else 1.0)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("strategy", "feature_layer"), [("default", -2), ("full", -1), ("default", 1)])
def test_the_captured_encoder_matches_transformers(tmp_path: Path, strategy: str, feature_layer: int) -> None:
    from transformers import LlavaForConditionalGeneration

    folder = _tiny_llava(tmp_path / "llava", strategy, feature_layer)
    config = ClipVisionConfig.from_llava(json.loads((folder / "config.json").read_text()))
    module = ClipVisionProjector(config)
    state = from_llava_weights(config, load_file(folder / "model.safetensors"))
    module.load_state_dict(state, strict=True)
    graph = capture_module(module.eval(), input_types(config), "encode_image")
    weights = {p.name: module.get_parameter(p.name).detach() for p in graph.params}
    pixel_values = torch.randn(
        2, 3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(1)
    )
    reference = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = reference.model.get_image_features(
            pixel_values=pixel_values,
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=strategy,
        )
    expected = expected.pooler_output if hasattr(expected, "pooler_output") else expected
    for image, want in zip(pixel_values, expected, strict=True):
        inputs = encoder_inputs(image.numpy(), config.patch_size, row_block=4)  # 17 rows padded to 20
        (rows,) = interpret(graph, weights, inputs)
        assert rows.shape[0] == 20
        got = rows[: config.num_rows] if config.keep_class_token else rows[1 : config.num_rows]
        assert got.shape == (config.num_image_tokens, 48) == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("backend", ["tvm", "onnxruntime"])
def test_the_compiled_encoder_matches_the_interpreter(tmp_path: Path, backend: str) -> None:
    folder = _tiny_llava(tmp_path / "llava")
    config = ClipVisionConfig.from_llava(json.loads((folder / "config.json").read_text()))
    module = ClipVisionProjector(config)
    module.load_state_dict(from_llava_weights(config, load_file(folder / "model.safetensors")), strict=True)
    graph = capture_module(module.eval(), input_types(config), "encode_image")
    weights = {p.name: module.get_parameter(p.name).detach() for p in graph.params}
    if backend == "tvm":
        from kiln.backends.targets import Target
        from kiln.backends.tvm.encoder import TVMImageEncoder, compile_encoder

        compile_encoder(graph, Target("cpu"), tmp_path / "encoder")
        encoder = TVMImageEncoder(tmp_path / "encoder", weights)
    else:
        from kiln.backends.onnxruntime.encoder import OrtImageEncoder
        from kiln.backends.onnxruntime.encoder import compile_encoder as compile_onnx
        from kiln.ir import Program

        compile_onnx(Program(graph, weights), tmp_path / "encoder")
        encoder = OrtImageEncoder(tmp_path / "encoder", weights)
    for seed in (1, 2):
        pixels = torch.randn(
            3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(seed)
        )
        inputs = encoder_inputs(pixels.numpy(), config.patch_size, row_block=4)
        (expected,) = interpret(graph, weights, inputs)
        got = encoder.encode(inputs)
        assert got.shape == tuple(expected.shape)
        assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(
            np.abs(got - expected.numpy()).max()
        )
