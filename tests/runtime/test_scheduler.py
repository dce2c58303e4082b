"""The scheduler through a real engine on the tiny model: a long prompt admitted while others decode is
chunked within the step budget, greedy tokens do not depend on the budget, and the priority policy
admits in priority order."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerOutput
from kiln.runtime.step_cost import MIN_PREFILL_TOKENS, StepCostModel

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class MeasuredOnce(StepCostModel):
    """Step costs as if measured (decodes 10 ms a step, prompt tokens 1 ms each), kept as they are so
    the budget each step gets is known."""

    def __init__(self) -> None:
        super().__init__(decode_line=(0.010, 0.0), prefill_seconds_per_token=0.001)

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        pass


def _prompt(seed: int, length: int) -> list[int]:
    return [2 + (seed * 31 + 7 * i) % 90 for i in range(length)]


def _record_steps(engine: Any) -> list[tuple[SchedulerOutput, int | None]]:
    """Each step's schedule, with the prompt-token budget the cost model gave it."""
    steps: list[tuple[SchedulerOutput, int | None]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        output = schedule()
        steps.append((output, engine.scheduler.step_cost.prefill_budget(output.decode_rows)))
        return output

    engine.scheduler.schedule = recording
    return steps


def test_a_long_prompt_admitted_while_others_decode_is_chunked_within_the_budget(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_num_batched_tokens=256, num_blocks=128)
    engine.scheduler.step_cost = MeasuredOnce()
    for i in range(3):
        engine.add_request(f"decoding{i}", _prompt(i, 9), SamplingParams(max_tokens=60, ignore_eos=True))
    while any(seq.num_computed_tokens < len(seq.prompt_token_ids) for seq in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    steps = _record_steps(engine)
    engine.add_request("long", _prompt(9, 150), GREEDY)
    long = engine.requests["long"].sequences[0]
    long_chunks = []
    while not long.output_token_ids:
        engine.step()
        step, budget = steps[-1]
        decoding = {chunk.seq.request.request_id for chunk in step.chunks if chunk.is_decode}
        assert decoding == {"decoding0", "decoding1", "decoding2"}  # no decoding stream skips a step
        assert budget == MIN_PREFILL_TOKENS  # 2 x 10 ms - 10 ms of prompt at 1 ms a token: the floor
        assert step.num_prefill_tokens <= budget
        long_chunks += [chunk.num_new_tokens for chunk in step.chunks if chunk.seq is long]
    assert sum(long_chunks) == 150 and len(long_chunks) == -(-150 // MIN_PREFILL_TOKENS)


@pytest.mark.parametrize("max_step_ms", [None, 0.001])
def test_greedy_tokens_do_not_depend_on_the_step_budget(make_tiny_engine, max_step_ms: float | None) -> None:
    prompts = {f"r{i}": _prompt(i, 10 + 37 * i) for i in range(5)}
    alone = {}
    for request_id, prompt in prompts.items():
        roomy = make_tiny_engine(max_num_batched_tokens=256, num_blocks=128)
        roomy.add_request(request_id, prompt, GREEDY)
        alone[request_id] = roomy.run_to_completion()[0].outputs[0].token_ids
    engine = make_tiny_engine(max_num_batched_tokens=256, num_blocks=128, max_step_ms=max_step_ms)
    steps = _record_steps(engine)
    finished = {}
    for request_id, prompt in prompts.items():  # each arrives while the ones before it decode
        engine.add_request(request_id, prompt, GREEDY)
        for _ in range(3):
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    finished.update({o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()})
    assert finished == alone
    if max_step_ms is not None:  # the smallest target: once measured, steps with decodes took the floor
        limited = [step for step, budget in steps if budget is not None and step.num_prefill_tokens]
        assert limited and all(step.num_prefill_tokens <= MIN_PREFILL_TOKENS for step in limited)


def test_the_priority_policy_admits_a_full_queue_in_priority_order(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_num_seqs=1, policy="priority")
    priorities = {"a": 5, "b": 1, "c": 3, "d": 1, "e": -2}
    for request_id, priority in priorities.items():
        engine.add_request(request_id, _prompt(ord(request_id), 6), GREEDY, priority=priority)
    order = [output.request_id for output in engine.run_to_completion()]
    assert order == ["e", "b", "d", "c", "a"]  # smaller first, then arrival


def test_a_priority_under_fcfs_is_refused_naming_the_policy(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        engine.add_request("a", _prompt(1, 6), GREEDY, priority=1)


def test_under_the_priority_policy_preemption_takes_the_largest_priority(make_tiny_engine) -> None:
    engine = make_tiny_engine(num_blocks=9, block_size=4, max_num_seqs=4, policy="priority")
    engine.add_request("urgent", _prompt(1, 6), SamplingParams(max_tokens=20, ignore_eos=True), priority=-1)
    engine.add_request("later", _prompt(2, 6), SamplingParams(max_tokens=20, ignore_eos=True), priority=4)
    engine.add_request("first", _prompt(3, 6), SamplingParams(max_tokens=20, ignore_eos=True), priority=0)
    preempted = []
    while engine.has_unfinished_requests():
        before = engine.scheduler.num_preemptions
        engine.step()
        if engine.scheduler.num_preemptions > before:
            preempted += [seq.request.request_id for seq in engine.scheduler.waiting]
    assert preempted and preempted[0] == "later"
