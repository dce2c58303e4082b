"""kv_cache_dtype: a float16 or bfloat16 cache (a cast), or float8 e4m3 with per-layer scales calibrated by
running the program once."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.compiler.build import PipelineOptions, optimize
from kiln.frontend.config import ModelConfig
from kiln.frontend.models import model_class
from kiln.ir import KV_CACHE_INPUT, Program
from kiln.ir.host_arrays import ir_dtype_of
from kiln.ir.ops.attention import FP8_MAX
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes import PassError, PassOptions
from kiln.passes.kv_cache import (
    BLOCK_SIZE,
    CALIBRATION_SEED,
    CALIBRATION_SEQUENCES,
    CALIBRATION_TOKENS,
    HEADROOM,
    kv_cache_dtype,
)

TINY = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
FP8_TOLERANCE = 2e-2  # max |logits with a float8 cache - float32 cache| / max |logits|, measured 3e-3


def _program(kv_cache_dtype: str | None = None, meta: bool = False) -> Program:
    config = ModelConfig(**TINY)
    with torch.device("meta"):
        shapes = model_class(config)(config).state_dict()
    generator = torch.Generator().manual_seed(3)
    weights = {
        name: torch.empty(t.shape, device="meta") if meta else torch.randn(t.shape, generator=generator) * 0.1
        for name, t in sorted(shapes.items())
    }
    return optimize(config, weights, PipelineOptions(opt_level=2, kv_cache_dtype=kv_cache_dtype)).program


def test_the_cache_becomes_float8_with_each_layers_calibrated_scales() -> None:
    plain = _program()
    fp8 = _program("fp8_e4m3")
    assert fp8.graph.input(KV_CACHE_INPUT).type.dtype == "f8e4m3"
    # the calibration by hand: the same prefill with a float32 cache, its largest |K| and |V| per layer
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    blocks = -(-CALIBRATION_TOKENS // BLOCK_SIZE)
    slices = [
        SequenceSlice(
            torch.randint(0, TINY["vocab_size"], (CALIBRATION_TOKENS,), generator=generator).tolist(),
            0,
            list(range(1 + s * blocks, 1 + (s + 1) * blocks)),
        )
        for s in range(CALIBRATION_SEQUENCES)
    ]
    reference = ReferenceExecutable(plain.graph, plain.weights)
    cache = reference.kv_cache_spec.allocate(1 + CALIBRATION_SEQUENCES * blocks, BLOCK_SIZE)
    reference.step(build_step_inputs(slices, BLOCK_SIZE), cache)
    attention = [node for node in fp8.graph.nodes if node.op == "paged_attention"]
    assert len(attention) == TINY["num_hidden_layers"]
    for node in attention:
        layer = node.attrs["layer"]
        expected = [float(abs(cache[layer, kind]).max()) * HEADROOM / FP8_MAX for kind in (0, 1)]
        assert node.attrs["kv_scale"] == pytest.approx(expected, rel=1e-6)
    assert kv_cache_dtype(plain, PassOptions())[1] is False  # only when asked
    assert kv_cache_dtype(plain, PassOptions(kv_cache_dtype="f32"))[1] is False  # already float32


def _errors_against_a_float32_cache(narrow: Program, seed: int) -> tuple[list[float], list[str]]:
    """A 40-token prefill and one decode step with `narrow` and with the float32-cache program: each
    step's max |logits difference| / max |logits|, and the two caches' dtypes (float32's first)."""
    prompt = torch.randint(
        1, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    steps = [
        build_step_inputs([SequenceSlice(prompt, 0, [1, 2, 3])], 16),
        build_step_inputs([SequenceSlice([7], 40, [1, 2, 3])], 16),
    ]
    runs, cache_dtypes = [], []
    for program in (_program(), narrow):
        executable = ReferenceExecutable(program.graph, program.weights)
        cache = executable.kv_cache_spec.allocate(4, 16)
        runs.append([torch.from_numpy(executable.step(inputs, cache)) for inputs in steps])
        cache_dtypes.append(ir_dtype_of(cache))
    float32_logits, narrow_logits = runs
    errors = [
        float((ours - theirs).abs().max() / theirs.abs().max())
        for ours, theirs in zip(narrow_logits, float32_logits, strict=True)
    ]
    return errors, cache_dtypes


def test_float8_logits_stay_near_the_float32_caches() -> None:
    errors, cache_dtypes = _errors_against_a_float32_cache(_program("fp8_e4m3"), seed=9)
    assert cache_dtypes == ["f32", "f8e4m3"]
    assert all(error < FP8_TOLERANCE for error in errors), errors


@pytest.mark.parametrize("cache_dtype", ["f16", "bf16"])
def test_a_sixteen_bit_cache_is_a_cast_with_no_scales(cache_dtype: str) -> None:
    narrow = _program(cache_dtype)
    assert narrow.graph.input(KV_CACHE_INPUT).type.dtype == cache_dtype
    assert all("kv_scale" not in node.attrs for node in narrow.graph.nodes if node.op == "paged_attention")
    errors, _ = _errors_against_a_float32_cache(narrow, seed=5)
    # a rounding of K and V to 11 (float16) or 8 (bfloat16) significant bits
    tolerance = {"f16": 2e-3, "bf16": 2e-2}[cache_dtype]
    assert all(error < tolerance for error in errors), errors


def test_values_past_the_range_saturate_instead_of_turning_to_nan() -> None:
    from kiln.ir.ops.attention import from_cache, to_cache

    values = torch.tensor([0.0, 1.0, -3.0, 1e6, -1e6])
    stored = to_cache(values, torch.float8_e4m3fn, 0.5)
    assert stored.dtype == torch.float8_e4m3fn
    assert from_cache(stored, 0.5).tolist() == [0.0, 1.0, -3.0, FP8_MAX * 0.5, -FP8_MAX * 0.5]
    assert torch.equal(to_cache(values, torch.float32, 1.0), values)


def test_calibration_needs_real_weights() -> None:
    with pytest.raises(PassError, match="weights are shapes only"):
        _program("fp8_e4m3", meta=True)


def test_an_unknown_cache_dtype_is_refused() -> None:
    with pytest.raises(PassError, match="unknown KV cache dtype 'fp8_e5m2'"):
        PassOptions(kv_cache_dtype="fp8_e5m2")
