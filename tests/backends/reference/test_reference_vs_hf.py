"""The captured IR, run by the reference backend, matches transformers float32 on tiny random models.

The models and the ragged batch are tests/backends/conftest.py's: each model made with transformers,
saved with `save_pretrained` and loaded back through our HF loader; 3 sequences mixing decode, a fresh
prefill and a chunked prefill over non-contiguous blocks of 16, prompts crossing block boundaries.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.compiler.build import PipelineOptions, optimize, runtime_tokenizer
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model

TOLERANCE = 1e-4  # max |ours - HF| / max |HF|


def _hf_last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_ragged_batch_matches_transformers(tiny_kind: str, tmp_path: Path, tiny_hf, ragged) -> None:
    kind = tiny_kind
    hf_model = tiny_hf(kind, tmp_path)
    source = load_model(str(tmp_path))
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    if kind == "mistral_window":
        assert source.config.sliding_window == 8

    tokens, first, second = ragged(1234)
    kv_cache = executable.kv_cache_spec.allocate(10, 16)

    # step 1: a and c prefill their first 20 and 10 tokens.
    logits = torch.from_numpy(executable.step(first, kv_cache))
    for row, (name, length) in enumerate((("a", 20), ("c", 10))):
        expected = _hf_last_logits(hf_model, tokens[name][:length])
        assert _relative_error(logits[row], expected) < TOLERANCE, (kind, name)

    # step 2: a decodes, b prefills from scratch, c continues its prefill across two block boundaries.
    logits = torch.from_numpy(executable.step(second, kv_cache))
    assert logits.shape == (3, 256) and logits.dtype == torch.float32
    for row, name in enumerate(("a", "b", "c")):
        expected = _hf_last_logits(hf_model, tokens[name])
        assert _relative_error(logits[row], expected) < TOLERANCE, (kind, name)


def test_engine_batch_invariance_for_each_family(
    tiny_kind: str, tmp_path: Path, tiny_hf, check_batch_invariance
) -> None:
    tiny_hf(tiny_kind, tmp_path)
    source = load_model(str(tmp_path))
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    check_batch_invariance(executable, runtime_tokenizer(source), tiny_kind, vocab=source.config.vocab_size)


def test_longrope_within_the_original_context_takes_the_short_factors(
    tmp_path: Path, tiny_hf, ragged
) -> None:
    """Compiled for a context no longer than the original one (here 64 of 512 positions), a longrope
    model rotates by its short factors and scales cos and sin by the attention factor, as transformers
    does for sequences within the original context."""
    hf_model = tiny_hf("phi3_longrope", tmp_path, {"original_max_position_embeddings": 64})
    source = load_model(str(tmp_path))
    scaling = source.config.rope_scaling
    assert scaling.rope_type == "longrope" and scaling.attention_factor > 1.0
    program = optimize(
        source.config, source.float_weights(), PipelineOptions(opt_level=0, context_len=64)
    ).program
    rope = next(n for n in program.graph.nodes if n.op == "rope")
    assert rope.attrs["factors"] == list(scaling.short_factor)
    executable = ReferenceExecutable(program.graph, program.weights)
    tokens, first, second = ragged(7)
    kv_cache = executable.kv_cache_spec.allocate(10, 16)
    executable.step(first, kv_cache)
    logits = torch.from_numpy(executable.step(second, kv_cache))
    for row, name in enumerate(("a", "b", "c")):
        expected = _hf_last_logits(hf_model, tokens[name])
        assert _relative_error(logits[row], expected) < TOLERANCE, name
