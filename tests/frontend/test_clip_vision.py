"""LLaVA-1.5's image encoder (CLIP tower + projector) captured into Kiln IR and run by the reference
interpreter, against transformers' LlavaForConditionalGeneration on the same random weights; then
compiled by ONNX Runtime, against the interpreter (TVM's compile of it: on the whole artifact in
tests/compiler/test_codegen_vision.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.frontend.models.clip_vision import encoder_inputs
from kiln.ir.interpreter import interpret

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("strategy", "feature_layer"), [("default", -2), ("full", -1), ("default", 1)])
def test_the_captured_encoder_matches_transformers(
    tmp_path: Path, strategy: str, feature_layer: int, tiny_llava, llava_encoder
) -> None:
    reference = tiny_llava(tmp_path, strategy=strategy, feature_layer=feature_layer)
    config, program = llava_encoder(tmp_path)
    pixel_values = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.model.get_image_features(
            pixel_values=pixel_values,
            vision_feature_layer=feature_layer,
            vision_feature_select_strategy=strategy,
        ).pooler_output
    for image, want in zip(pixel_values, expected, strict=True):
        inputs = encoder_inputs(image.numpy(), config.patch_size, row_block=4)  # 17 rows padded to 20
        (rows,) = interpret(program.graph, program.weights, inputs)
        assert rows.shape[0] == 20
        got = rows[: config.num_rows] if config.keep_class_token else rows[1 : config.num_rows]
        assert got.shape == (config.num_image_tokens, 48) == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("backend", ["onnxruntime"])  # TVM's: tests/compiler/test_codegen_vision.py
def test_the_compiled_encoder_matches_the_interpreter(
    tmp_path: Path, backend: str, tiny_llava, llava_encoder, compile_image_encoder
) -> None:
    tiny_llava(tmp_path / "llava")
    config, program = llava_encoder(tmp_path / "llava")
    encoder = compile_image_encoder(program, backend, tmp_path / "encoder")
    for seed in (1, 2):
        pixels = torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(seed))
        inputs = encoder_inputs(pixels.numpy(), config.patch_size, row_block=4)
        (expected,) = interpret(program.graph, program.weights, inputs)
        got = encoder.encode(inputs)
        assert got.shape == tuple(expected.shape)
        assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(
            np.abs(got - expected.numpy()).max()
        )
