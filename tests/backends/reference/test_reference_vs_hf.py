"""The captured IR, run by the reference backend, matches transformers float32 on tiny random models.

Each model is made here with transformers, saved with `save_pretrained` and loaded back through our
HF loader; a ragged batch of 3 sequences mixes decode, a fresh prefill and a chunked prefill over
non-contiguous blocks of 16, with prompts crossing block boundaries.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

BLOCK_SIZE = 16
TOLERANCE = 1e-4  # max |ours - HF| / max |HF|
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
TINY_MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def _save_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 256)}}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    fast.save_pretrained(path)


def _make_tiny(kind: str, path: Path) -> torch.nn.Module:
    config_cls, model_cls, extra = TINY_MODELS[kind]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them random too
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model


def _hf_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("kind", sorted(TINY_MODELS))
def test_ragged_batch_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf_model = _make_tiny(kind, tmp_path)
    source = load_model(str(tmp_path))
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    if kind == "mistral_window":
        assert source.config.sliding_window == 8

    generator = torch.Generator().manual_seed(1234)
    tokens = {
        name: torch.randint(1, 256, (n,), generator=generator).tolist()
        for name, n in (("a", 21), ("b", 35), ("c", 35))
    }
    tables = {"a": [3, 7], "b": [1, 5, 9], "c": [2, 8, 4]}
    kv_cache = executable.kv_cache_spec.allocate(10, BLOCK_SIZE)

    # step 1: a and c prefill their first 20 and 10 tokens.
    first = build_step_inputs(
        [SequenceSlice(tokens["a"][:20], 0, tables["a"]), SequenceSlice(tokens["c"][:10], 0, tables["c"])],
        BLOCK_SIZE,
    )
    logits = executable.step(first, kv_cache)
    for row, (name, length) in enumerate((("a", 20), ("c", 10))):
        expected = _hf_last_logits(hf_model, tokens[name][:length])
        assert _relative_error(logits[row], expected) < TOLERANCE, (kind, name)

    # step 2: a decodes, b prefills from scratch, c continues its prefill across two block boundaries.
    second = build_step_inputs(
        [
            SequenceSlice(tokens["a"][20:], 20, tables["a"]),
            SequenceSlice(tokens["b"], 0, tables["b"]),
            SequenceSlice(tokens["c"][10:], 10, tables["c"]),
        ],
        BLOCK_SIZE,
    )
    logits = executable.step(second, kv_cache)
    assert logits.shape == (3, 256) and logits.dtype == torch.float32
    for row, name in enumerate(("a", "b", "c")):
        expected = _hf_last_logits(hf_model, tokens[name])
        assert _relative_error(logits[row], expected) < TOLERANCE, (kind, name)
