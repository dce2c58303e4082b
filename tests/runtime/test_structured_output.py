"""Structured output pieces: the constraint's validation, the sampler's token mask, and grammars
compiled against SmolLM2's vocabulary (errors, the cache, what a mask allows)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.compiler.build import runtime_tokenizer
from kiln.frontend.load import load_model
from kiln.runtime.sampler import SequenceSampling, apply_token_bitmask, make_generator, sample
from kiln.runtime.sampling_params import SamplingParams, StructuredOutput
from kiln.runtime.structured_output import GrammarError, Grammars


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("xml", "<a/>", "structured output kind must be one of"),
        ("regex", "", "the regex constraint must be non-empty"),
        ("json", "{not json", "the json constraint is not valid JSON"),
        ("json", "[1, 2]", "a JSON schema must be an object"),
        ("choice", '["a", 1]', "choice must be a non-empty list of strings"),
    ],
)
def test_constraints_are_checked(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(kind, spec)


def test_the_mask_keeps_only_allowed_tokens() -> None:
    logits = np.zeros((2, 40), dtype=np.float32)
    bitmask = np.array([[0b1010, 1 << 3], [-1, -1]], dtype=np.int32)  # row 0: tokens 1, 3, 35
    masked = apply_token_bitmask(logits, bitmask)
    assert np.flatnonzero(np.isfinite(masked[0])).tolist() == [1, 3, 35]
    assert np.isfinite(masked[1]).all()
    rows = [SequenceSampling(SamplingParams(temperature=0, logprobs=0), make_generator(0)) for _ in range(2)]
    raw = np.arange(80, dtype=np.float32).reshape(2, 40)
    chosen = sample(raw, rows, token_bitmask=bitmask)
    assert [c.token_id for c in chosen] == [35, 39]
    log_softmax = raw[0] - raw[0].max() - np.log(np.exp(raw[0] - raw[0].max()).sum())
    assert chosen[0].logprob == pytest.approx(float(log_softmax[35]))  # the model's own


@pytest.fixture(scope="module")
def grammars(smollm2_gguf_path) -> Grammars:
    source = load_model(str(smollm2_gguf_path))
    return Grammars(runtime_tokenizer(source), source.config.vocab_size)


def test_errors_name_the_constraint_and_the_reason(grammars: Grammars) -> None:
    with pytest.raises(GrammarError, match=r"the JSON schema does not compile: .*nonsense"):
        grammars.compile(StructuredOutput.json_schema({"type": "nonsense"}))
    with pytest.raises(GrammarError, match=r"the regex does not compile: Regex parsing error .*Unclosed"):
        grammars.compile(StructuredOutput("regex", "[a-"))


def test_grammars_are_cached_and_masks_follow_the_text(grammars: Grammars) -> None:
    constraint = StructuredOutput.choice(["yes", "no"])
    assert grammars.submit(constraint) is grammars.submit(StructuredOutput.choice(["yes", "no"]))
    constrained = grammars.constraint(grammars.compile(constraint), None, [])
    tokenizer = grammars.tokenizer
    bitmask = grammars.bitmask([constrained])
    assert bitmask is not None and grammars.bitmask([None]) is None
    assert bitmask.dtype == np.int32 and bitmask.shape == (1, -(-grammars.vocab_size // 32))
    allowed = apply_token_bitmask(np.zeros((1, grammars.vocab_size), dtype=np.float32), bitmask)
    first = {tokenizer.decode([int(t)]) for t in np.flatnonzero(np.isfinite(allowed[0]))}
    assert first and all("yes".startswith(t) or "no".startswith(t) for t in first)
    for token in tokenizer.encode("yes", add_special_tokens=False):
        constrained.accept(token)
    allowed = apply_token_bitmask(
        np.zeros((1, grammars.vocab_size), dtype=np.float32), grammars.bitmask([constrained])
    )
    assert set(np.flatnonzero(np.isfinite(allowed[0])).tolist()) <= set(tokenizer.eos_token_ids)
