"""Perplexity of SmolLM2 on a public-domain text (tests/fixtures/public_domain.txt): the float32
baseline (the GGUF dequantized), the GGUF Q4_1 blocks imported as they are (equal to the baseline),
and re-quantized from the baseline with our int8 (within 1%) and int4 g32 (reported)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.compiler.build import gguf_blocks
from kiln.ir import Program
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes import PassManager, PassOptions, pipeline

TEXT = Path(__file__).parent.parent / "fixtures" / "public_domain.txt"
WINDOW = 512
NUM_TOKENS = 1024


def perplexity(program: Program, token_ids: list[int]) -> float:
    executable = ReferenceExecutable(program.graph, program.weights)
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, WINDOW):
        window = token_ids[start : start + WINDOW]
        blocks = list(range(1, WINDOW // 16 + 1))
        cache = executable.kv_cache_spec.allocate(len(blocks) + 1, 16)
        inputs = build_step_inputs([SequenceSlice(window, 0, blocks, logits_at=range(len(window) - 1))], 16)
        logprobs = torch.log_softmax(torch.from_numpy(executable.step(inputs, cache)), dim=-1)
        targets = torch.tensor(window[1:])
        total_nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(window) - 1
    return math.exp(total_nll / count)


@pytest.mark.slow
def test_quantized_perplexity(smollm2_built, smollm2_gguf_path, capsys) -> None:
    from kiln.frontend.gguf_loader import load_gguf

    token_ids = smollm2_built.tokenizer.encode(TEXT.read_text())[:NUM_TOKENS]
    assert len(token_ids) == NUM_TOKENS
    variants = {
        "float32 baseline": PassOptions(),
        "GGUF Q4_1 imported": PassOptions(
            quantization="gguf", gguf_blocks=gguf_blocks(load_gguf(smollm2_gguf_path))
        ),
        "int8": PassOptions(quantization="int8"),
        "int4 g32": PassOptions(quantization="int4", group_size=32),
    }
    results = {}
    for name, options in variants.items():
        program, _ = PassManager(pipeline(2, options)).run(smollm2_built.captured, options)
        results[name] = perplexity(program, token_ids)
    with capsys.disabled():
        print("\nperplexity on", NUM_TOKENS, "tokens:", {k: round(v, 4) for k, v in results.items()})
    baseline = results["float32 baseline"]
    assert 1 < baseline < 100
    assert abs(results["GGUF Q4_1 imported"] - baseline) / baseline < 1e-5
    assert abs(results["int8"] - baseline) / baseline < 0.01
    # the baseline's weights lie on Q4_1's grid of 32-value groups, which int4 g32's float zero points
    # reproduce: it lands on the baseline (int4 g64 does not: 33.4 on this text)
    assert abs(results["int4 g32"] - baseline) / baseline < 0.01
