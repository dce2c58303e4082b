"""A LLaVA directory loads its language model: logits on a text-only prompt equal transformers'
LlavaForConditionalGeneration's (the reference backend), whatever prefixes its weights were saved with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.backends.reference.executable import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.ir.step import SequenceSlice, build_step_inputs
from tests.frontend.llava_steps import check_image_rows_in_the_step

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("prefix", ["as saved", "model.language_model"])
def test_a_llava_directory_serves_its_language_model(tmp_path: Path, prefix: str, tiny_llava) -> None:
    reference = tiny_llava(tmp_path, with_tokenizer=True)
    if prefix != "as saved":  # transformers 4.5x's names: model.language_model.*, lm_head.*
        weights = load_file(tmp_path / "model.safetensors")
        renamed = {
            name.replace("language_model.model.", "model.language_model.").replace(
                "language_model.lm_head.", "lm_head."
            ): tensor
            for name, tensor in weights.items()
        }
        save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    source = load_model(str(tmp_path))
    assert source.config.architecture == "LlamaForCausalLM" and source.config.vocab_size == 300
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    tokens = torch.randint(3, 298, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    inputs = build_step_inputs([SequenceSlice(tokens, 0, [1], logits_at=range(len(tokens)))], 16)
    logits = torch.from_numpy(executable.step(inputs, executable.kv_cache_spec.allocate(2, 16)))
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([tokens])).logits[0]
    assert torch.allclose(logits, expected, atol=1e-4, rtol=0), float((logits - expected).abs().max())


@pytest.mark.parametrize("backend", ["reference", "onnxruntime"])  # TVM: in test_codegen_vision.py
def test_image_rows_in_the_step_give_transformers_logits(
    tmp_path: Path, backend: str, tiny_llava, llava_encoder
) -> None:
    """The text model's step with image rows (ir/step.py IMAGE_ROWS_INPUT) fed by the captured encoder:
    LLaVA's logits for a prompt with an image, the image's tokens cut across two chunked-prefill steps,
    then a step without an image. TVM's step is checked so on the whole artifact it compiles (with the
    encoder and a CUDA target) in tests/compiler/test_codegen_vision.py."""
    import dataclasses

    reference = tiny_llava(tmp_path, with_tokenizer=True)
    vision, encoder = llava_encoder(tmp_path)

    source = load_model(str(tmp_path))
    config = dataclasses.replace(source.config, image_rows=True)
    captured = capture_weights(config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    if backend != "reference":
        from kiln.backends.base import CompileSettings
        from kiln.backends.onnxruntime.backend import OnnxRuntimeBackend
        from kiln.backends.targets import Target
        from kiln.ir import Program

        program = Program(captured.graph, captured.weights)
        compiler = OnnxRuntimeBackend()
        compiler.compile(program, Target("cpu"), tmp_path / backend, CompileSettings(num_threads=2))
        executable = compiler.load(tmp_path / backend, program.weights, Target("cpu"))
    check_image_rows_in_the_step(executable, reference, vision, encoder, config.vocab_size)
