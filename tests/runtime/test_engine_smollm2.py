"""The engine on SmolLM2 (reference backend, float32): batch invariance, prefix caching, n > 1, stops."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig


def _engine(built, num_blocks: int = 256, max_num_seqs: int = 16, budget: int = 64) -> LLMEngine:
    config = EngineConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(max_num_seqs, budget))
    return LLMEngine(built.executable, built.tokenizer, built.model_id, 2048, config)


def _prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = [5 + 9 * i for i in range(count)]  # 5 .. 140 tokens: many cross block and chunk boundaries
    return [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in lengths]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    return {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}


@pytest.mark.slow
def test_batch_invariance_with_chunked_prefill_and_preemption(smollm2_o2, check_batch_invariance) -> None:
    check_batch_invariance(smollm2_o2.executable, smollm2_o2.tokenizer, smollm2_o2.model_id)


@pytest.mark.slow
def test_prefix_caching_computes_only_the_unshared_tokens(smollm2_o2) -> None:
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(100, 49000, (200,), generator=generator).tolist()
    first, second = [*prefix, 1000, 2000, 3000], [*prefix, 4000, 5000, 6000, 7000]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    engine = _engine(smollm2_o2)
    _run(engine, [first], params)
    before = engine.stats.num_computed_tokens
    engine.add_request("second", second, params)
    (output,) = engine.run_to_completion()
    shared_blocks = 200 // 16
    assert output.num_cached_tokens == shared_blocks * 16
    # the unshared prompt tokens, then one token per decode step after the first sampled one
    assert engine.stats.num_computed_tokens - before == (len(second) - shared_blocks * 16) + 4

    uncached = LLMEngine(
        smollm2_o2.executable,
        smollm2_o2.tokenizer,
        smollm2_o2.model_id,
        2048,
        EngineConfig(num_blocks=256, enable_prefix_caching=False),
    )
    assert _run(uncached, [second], params)["r0"] == output.outputs[0].token_ids


@pytest.mark.slow
def test_seeded_sampling_reproduces_across_batches(smollm2_o2) -> None:
    prompts = _prompts(4)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = _run(_engine(smollm2_o2), [prompts[2]], seeded)["r0"]
    engine = _engine(smollm2_o2)
    for i, prompt in enumerate(prompts):
        params = seeded if i == 2 else SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    together = {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}
    assert together["r2"] == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=8, ignore_eos=True)
    assert _run(_engine(smollm2_o2), [prompts[2]], other_seed)["r0"] != alone


@pytest.mark.slow
def test_n_samples_share_the_prompt_blocks(smollm2_o2) -> None:
    prompt = _prompts(8)[7]  # 68 tokens: 4 full blocks and a partial one
    engine = _engine(smollm2_o2)
    engine.add_request(
        "r", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    )
    (output,) = engine.run_to_completion()
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # samples 1 and 2 reuse the 4 full prompt blocks and compute only the 4 remaining prompt tokens
    assert engine.stats.num_computed_tokens == len(prompt) + 2 * (len(prompt) - 64) + 3 * 5


@pytest.mark.slow
def test_stop_string_spanning_tokens_is_cut(smollm2_o2) -> None:
    tokenizer = smollm2_o2.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = _run(_engine(smollm2_o2), [prompt], params)["r0"]
    text = tokenizer.decode(full)
    pieces = [tokenizer.decode([t]) for t in full]
    boundary = len(pieces[0]) + len(pieces[1])  # a stop string from the end of token 2 into token 3
    stop = text[boundary - 2 : boundary + 2]
    engine = _engine(smollm2_o2)
    engine.add_request(
        "s", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    (output,) = engine.run_to_completion()
    completion = output.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    assert stop not in completion.text


def test_prompt_logprobs_match_a_direct_computation(smollm2_o2) -> None:
    prompt = _prompts(3)[2][:20]
    engine = _engine(smollm2_o2, budget=8)  # chunked: the rows come from three steps
    engine.add_request(
        "p", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=3)
    )
    (output,) = engine.run_to_completion()
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    direct = smollm2_o2.executable.kv_cache_spec.allocate(4, 16)
    from kiln.ir.step import SequenceSlice, build_step_inputs

    rows = torch.from_numpy(
        smollm2_o2.executable.step(
            build_step_inputs([SequenceSlice(prompt, 0, [1, 2], logits_at=range(len(prompt) - 1))], 16),
            direct,
        )
    )
    expected = torch.log_softmax(rows, dim=-1)
    for position, entry in enumerate(output.prompt_logprobs[1:]):
        token = prompt[position + 1]
        want = float(expected[position, token])  # float32: chunked steps sum in another order
        assert entry is not None and abs(entry[token] - want) < 1e-5 * max(1.0, abs(want))
        assert len(entry) in (2, 3)  # the actual token plus the top 2 (which may include it)
    (top,) = output.outputs[0].logprobs
    assert output.outputs[0].token_ids[0] in top and len(top) in (3, 4)
    assert output.outputs[0].cumulative_logprob == top[output.outputs[0].token_ids[0]]
    engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=2))
    (plain,) = engine.run_to_completion()
    assert plain.outputs[0].cumulative_logprob is None  # no log-softmax for a request without logprobs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_a_prompt_longer_than_the_context_is_refused(smollm2_o2) -> None:
    engine = _engine(smollm2_o2)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(100, 2200)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request("room", list(range(100, 2040)), SamplingParams(max_tokens=200))
    small = _engine(smollm2_o2, num_blocks=5)
    with pytest.raises(ValueError, match="KV cache"):
        small.add_request("cache", list(range(100, 160)), SamplingParams(max_tokens=20))
    assert not engine.has_unfinished_requests() and not small.has_unfinished_requests()
