"""`--quantization q4_k_m` (and the other llama.cpp mixes) on a HF checkpoint: the pipeline takes the blocks
llama-quantize would write (their types: tests/passes/test_gguf_mix.py; their bytes:
tests/passes/test_gguf_encode.py) through the GGUF path's import and kernels, so the model computes with
exactly the blocks' values: logits of the reference backend and greedy tokens of the TVM CPU build equal
transformers holding the blocks' dequantized weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kiln
from kiln.backends.base import allocate_kv_cache
from kiln.compiler.build import build_reference
from kiln.compiler.options import OptionsError, PipelineOptions
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes.quantize.gguf_encode import EncodedTensor
from tests.backends.conftest import save_tiny_hf

PROMPT = [3, 17, 9, 120, 45, 2, 77, 200, 31, 8]
# 2 layers: llama-quantize gives layer 1's value and down projections (and the LM head) Q6_K, the rest Q4_K
Q4_K_M_TYPES = {
    **{f"model.layers.0.{path}.weight": "Q4_K" for path in ("self_attn.v_proj", "mlp.down_proj")},
    **{f"model.layers.1.{path}.weight": "Q6_K" for path in ("self_attn.v_proj", "mlp.down_proj")},
    **{
        f"model.layers.{layer}.{path}.weight": "Q4_K"
        for layer in (0, 1)
        for path in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj")
    },
    **{f"model.layers.{layer}.mlp.up_proj.weight": "Q4_K" for layer in (0, 1)},
    "model.embed_tokens.weight": "Q4_K",
    "lm_head.weight": "Q6_K",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama whose rows (256 values) take the K-quants, saved in bf16 as checkpoints are."""
    folder = tmp_path_factory.mktemp("mix") / "llama"
    model = save_tiny_hf("llama", folder, {"hidden_size": 256, "intermediate_size": 512})
    with torch.no_grad():  # the weights only: rope's frequencies stay float32, as transformers computes them
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    return folder, model


def with_blocks_values(model: torch.nn.Module, types: dict[str, str]) -> torch.nn.Module:
    """A copy of `model` with each weight in `types` replaced by its blocks' dequantized values."""
    changed = copy.deepcopy(model)
    state = changed.state_dict()
    for name, ggml_type in types.items():
        state[name] = EncodedTensor(ggml_type, state[name]).dequantize()
    changed.load_state_dict(state)
    return changed


def test_the_reference_backend_computes_with_the_blocks_values(checkpoint: Any) -> None:
    folder, model = checkpoint
    built = build_reference(str(folder), PipelineOptions(quantization="q4_k_m"))
    assert built.program.weights.keys().isdisjoint(Q4_K_M_TYPES)  # every one of them became blocks
    reference = with_blocks_values(model, Q4_K_M_TYPES)
    cache = allocate_kv_cache(built.executable, 2, 16)
    step = build_step_inputs([SequenceSlice(PROMPT, 0, [1], logits_at=range(len(PROMPT)))], 16)
    ours = np.asarray(built.executable.step(step, cache))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-5
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    with torch.no_grad():
        float_logits = model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ours - float_logits).max() > 1e-3  # the blocks' values, not the float checkpoint's


@pytest.mark.slow  # a TVM compile of the K-quant kernels, checked by tests/backends/test_gguf_kquants.py too
def test_the_tvm_cpu_build_gives_transformers_greedy_tokens_on_the_blocks_values(checkpoint: Any) -> None:
    folder, model = checkpoint
    llm = kiln.LLM(str(folder), quantization="q4_k_m", num_blocks=32)
    params = kiln.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    reference = with_blocks_values(model, Q4_K_M_TYPES)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0]
    assert list(ours) == theirs[len(PROMPT) :].tolist()


def test_a_mix_of_a_gguf_with_blocks_is_refused(smollm2_gguf_path: Path) -> None:
    with pytest.raises(OptionsError, match=r"quantizes float weights, and .* holds GGUF blocks already"):
        kiln.LLM(str(smollm2_gguf_path), quantization="q4_k_m")
