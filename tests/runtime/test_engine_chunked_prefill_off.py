"""SchedulerConfig(enable_chunked_prefill=False): a prompt is computed in one step, so one longer than
max_num_batched_tokens is refused up front rather than left waiting forever."""

from __future__ import annotations

import pytest

from kiln.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BUDGET = 16


def _prompt(length: int, first: int = 2) -> list[int]:
    return [first + i % 90 for i in range(length)]


def test_a_prompt_over_the_step_budget_is_refused(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_num_batched_tokens=BUDGET, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"^prompt has 17 tokens") as refused:
        engine.add_request("long", _prompt(BUDGET + 1), GREEDY)
    message = str(refused.value)
    assert "max_num_batched_tokens" in message and f"the {BUDGET} tokens" in message
    assert "chunked prefill" in message and "at least 17" in message
    assert not engine.has_unfinished_requests()
    engine.add_request("fits", _prompt(BUDGET), GREEDY)
    (done,) = engine.run_to_completion()
    assert len(done.outputs[0].token_ids) == GREEDY.max_tokens


def test_a_cached_prefix_does_not_make_a_long_prompt_fit(make_tiny_engine) -> None:
    """The whole prompt counts: its cached prefix may be evicted before it is scheduled."""
    engine = make_tiny_engine(max_num_batched_tokens=BUDGET, enable_chunked_prefill=False)
    engine.add_request("prefix", _prompt(BUDGET), GREEDY)
    engine.run_to_completion()
    with pytest.raises(ValueError, match=r"^prompt has 20 tokens"):
        engine.add_request("longer", _prompt(BUDGET + 4), GREEDY)


def test_with_chunked_prefill_a_long_prompt_is_served(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_num_batched_tokens=BUDGET)
    engine.add_request("long", _prompt(3 * BUDGET), GREEDY)
    (done,) = engine.run_to_completion()
    assert done.finished and len(done.outputs[0].token_ids) == GREEDY.max_tokens


def test_a_sequence_preempted_past_the_step_budget_is_recomputed(make_tiny_engine) -> None:
    """Two requests outgrow a cache of 8 blocks; the newer is preempted with more tokens than one step
    computes, so it is readmitted in chunks and finishes with the tokens it makes alone."""
    requests = {
        "old": (_prompt(4, first=5), SamplingParams(temperature=0, max_tokens=27, ignore_eos=True)),
        "new": (_prompt(8, first=10), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
    }
    alone = {}
    for request_id, (prompt, params) in requests.items():
        roomy = make_tiny_engine(max_num_batched_tokens=BUDGET, enable_chunked_prefill=False)
        roomy.add_request(request_id, prompt, params)
        alone[request_id] = roomy.run_to_completion()[0].outputs[0].token_ids
    engine = make_tiny_engine(
        num_blocks=9, max_num_batched_tokens=BUDGET, enable_chunked_prefill=False, enable_prefix_caching=False
    )
    engine.add_request("old", *requests["old"])
    engine.step()
    engine.add_request("new", *requests["new"])
    finished = {}
    for _ in range(200):  # a bound: without it a regression loops forever
        if not engine.has_unfinished_requests():
            break
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert engine.scheduler.num_preemptions > 0
    assert finished == alone
