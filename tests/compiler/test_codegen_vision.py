"""A vision-language model's artifact: the image encoder compiled beside the step for every target (a
second entry point, `encode_image`), its weights a file of their own, the manifest's `vision` saying how
an image becomes rows. One artifact for this CPU and `cuda:sm_87` (cross-compiled: an encoder library
with sm_87 device code); the CPU target loads, its encoder gives the interpreter's rows and its step with
image rows gives transformers' logits: LLaVA's whole-model check on TVM (ONNX Runtime's compiles of the
encoder and of the step: tests/frontend/test_clip_vision.py, test_llava.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.backends.targets import Target
from kiln.backends.tvm.cuda import check_cuda_library
from kiln.compiler import ModelOptions, resolve
from kiln.compiler.codegen import compile_model
from kiln.frontend.models.clip_vision import encoder_inputs
from kiln.ir.interpreter import interpret
from kiln.ir.vision import clip_encoder_inputs
from kiln.runtime.artifact import load_artifact
from kiln.runtime.vision import ROW_BLOCK
from tests.frontend.llava_steps import check_image_rows_in_the_step

pytest.importorskip("transformers")


def test_the_encoder_is_compiled_beside_the_step_for_each_target(
    tmp_path: Path, tiny_llava, llava_encoder
) -> None:
    reference = tiny_llava(tmp_path / "hf", with_tokenizer=True)
    # a float32 KV cache: the step's logits are held to transformers' within 1e-4
    plan = resolve(ModelOptions(str(tmp_path / "hf"), target="cpu,cuda:sm_87", kv_cache_dtype="f32"))
    result = compile_model(plan, tmp_path / "artifact")
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    vision = manifest["vision"]
    assert vision["family"] == "llava" and vision["image_token_id"] == 299
    assert vision["num_image_tokens"] == 16 and vision["first_row"] == 1
    cpu, gpu = manifest["targets"]["cpu"]["encoder"], manifest["targets"]["cuda:sm_87"]["encoder"]
    assert cpu["weights"] == gpu["weights"] != manifest["targets"]["cpu"]["weights"]
    assert "cpu/encoder/encode_image.so" in cpu["code"] and all(f in manifest["files"] for f in gpu["code"])
    lines = check_cuda_library(result.path / gpu["folder"] / "encode_image.so", Target.parse("cuda:sm_87"))
    assert any("carries a cubin for sm_87" in line for line in lines), lines

    artifact = load_artifact(tmp_path / "artifact", target="cpu")
    assert artifact.vision is not None
    config, program = llava_encoder(tmp_path / "hf")
    image = Image.fromarray(np.random.default_rng(2).integers(0, 255, (31, 29, 3), dtype=np.uint8))
    embedding = artifact.vision.embed(image)
    (pixels,) = artifact.vision.pixel_values(image)
    (rows,) = interpret(
        program.graph, program.weights, clip_encoder_inputs(pixels, config.patch_size, ROW_BLOCK)
    )
    assert embedding.rows.shape == (16, 48)
    assert np.allclose(embedding.rows, rows[1:17].numpy(), atol=1e-4, rtol=0)
    for seed in (1, 2):  # the compiled encoder on its own: every row of random pixels, padding included
        pixels = torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(seed))
        inputs = encoder_inputs(pixels.numpy(), config.patch_size, row_block=4)
        (expected,) = interpret(program.graph, program.weights, inputs)
        got = artifact.vision.encoder.encode(inputs)
        assert got.shape == tuple(expected.shape)
        assert np.allclose(got, expected.numpy(), atol=1e-4, rtol=0), float(
            np.abs(got - expected.numpy()).max()
        )
    # the step with image rows, as tests/frontend/test_llava.py checks on the reference and ONNX Runtime
    check_image_rows_in_the_step(artifact.executable, reference, config, program, vocab_size=300)
