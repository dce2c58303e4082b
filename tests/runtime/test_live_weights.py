"""Weights replaced between requests, pause (wait, abort), sleep and wake-up, on the engine and the async
engine (runtime/live_weights.py), with the tiny model's reference executable and a second one of other
weights."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.live_weights import EngineAsleepError
from kiln.runtime.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIG, tiny_weights

PROMPT = list(range(3, 15))  # three full blocks of 4: a prefix the cache keeps
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def other_weights() -> ReferenceExecutable:
    generator = torch.Generator().manual_seed(7)
    weights = {
        name: w + 0.3 * torch.randn(w.shape, generator=generator) for name, w in tiny_weights().items()
    }
    captured = capture_weights(TINY_CONFIG, weights)
    return ReferenceExecutable(captured.graph, captured.weights)


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.002)


def run(engine: Any, request_id: str) -> Any:
    engine.add_request(request_id, PROMPT, GREEDY)
    (final,) = engine.run_to_completion()
    return final


def test_new_weights_serve_from_the_next_request_and_the_prefix_cache_is_dropped(
    make_tiny_engine, other_weights
) -> None:
    engine = make_tiny_engine()
    fresh = make_tiny_engine()
    fresh.runner.executable = other_weights
    first, again = run(engine, "a"), run(engine, "b")
    assert again.num_cached_tokens == 8 and first.weight_version == 0
    old = engine.replace_executable(other_weights, 1)
    assert old is not other_weights
    after = run(engine, "c")
    assert after.num_cached_tokens == 0  # the old weights' K/V is not reused
    assert after.weight_version == 1
    assert after.outputs[0].token_ids == run(fresh, "d").outputs[0].token_ids
    assert after.outputs[0].token_ids != first.outputs[0].token_ids


def test_weights_change_only_with_no_request_in_flight(make_tiny_engine, other_weights) -> None:
    engine = make_tiny_engine()
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match="1 requests in flight"):
        engine.replace_executable(other_weights, 1)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.sleep(1)
    (final,) = engine.abort_all()
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    engine.replace_executable(other_weights, 1)


def test_sleep_frees_the_kv_cache_and_wake_up_gives_a_zeroed_one(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    before = run(engine, "a").outputs[0].token_ids
    engine.sleep(1)
    assert engine.kv_cache is None and engine.asleep == 1
    engine.wake_up()
    assert engine.asleep == 0 and not engine.kv_cache.any()
    assert run(engine, "b").outputs[0].token_ids == before


def test_a_level_two_sleep_drops_the_weights_until_they_are_replaced(make_tiny_engine, tiny_model) -> None:
    engine = make_tiny_engine()
    before = run(engine, "a").outputs[0].token_ids
    dropped = engine.sleep(2)
    assert dropped is tiny_model[0] and engine.weights_dropped
    with pytest.raises(RuntimeError, match="replace them before waking up"):
        engine.wake_up()
    engine.replace_executable(tiny_model[0], 1)
    engine.wake_up()
    assert run(engine, "b").outputs[0].token_ids == before


def test_an_executable_of_another_step_is_refused(make_tiny_engine, tiny_draft_model) -> None:
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="KV cache"):
        engine.replace_executable(tiny_draft_model, 1)
    assert engine.weight_version == 0


def test_the_async_engine_waits_for_requests_in_flight_and_holds_new_ones(
    make_tiny_engine, other_weights
) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(make_tiny_engine(step_delay_s=0.01))
        try:

            async def tokens(request_id: str) -> tuple[list[int], int]:
                final = None
                async for output in engine.generate(PROMPT, GREEDY, request_id):
                    final = output
                assert final is not None
                return final.outputs[0].token_ids, final.weight_version

            in_flight = asyncio.create_task(tokens("old"))
            await until(lambda: engine.stats().num_prompt_tokens > 0)  # admitted
            update = asyncio.create_task(engine.replace_weights(lambda: other_weights, "disk", "disk:x"))
            await until(lambda: engine.paused)
            later = asyncio.create_task(tokens("new"))  # arrives during the update's pause: held
            old_tokens, old_version = await in_flight
            version = await update
            new_tokens, new_version = await later
            assert (old_version, new_version, version.number, version.source) == (0, 1, 1, "disk:x")
            assert old_tokens != new_tokens
            assert engine.stats().weight_updates == {("disk", "ok"): 1}

            def broken() -> Any:
                raise ValueError("no such tensor")

            with pytest.raises(ValueError, match="no such tensor"):
                await engine.replace_weights(broken, "disk", "disk:y")
            assert engine.weight_version.number == 1 and not engine.paused
            assert (await tokens("again"))[0] == new_tokens
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_pause_abort_ends_requests_in_flight_and_resume_starts_held_ones(make_tiny_engine) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(make_tiny_engine(step_delay_s=0.01))
        try:

            async def last(request_id: str, params: SamplingParams) -> Any:
                final = None
                async for output in engine.generate(PROMPT, params, request_id):
                    final = output
                return final

            long = asyncio.create_task(last("long", SamplingParams(max_tokens=200, temperature=0.0)))
            await until(lambda: engine.stats().num_prompt_tokens > 0)  # admitted
            await engine.pause("abort")
            aborted = await long
            assert aborted.outputs[0].finish_reason == "abort" and engine.paused
            held = asyncio.create_task(last("held", GREEDY))
            await asyncio.sleep(0.1)
            assert not held.done()
            await engine.resume()
            assert (await held).outputs[0].finish_reason in ("length", "stop")
            with pytest.raises(ValueError, match="keep is refused"):
                await engine.pause("keep")  # type: ignore[arg-type]
            await engine.sleep(1)
            with pytest.raises(EngineAsleepError, match=r"sleeps \(level 1\)"):
                await last("asleep", GREEDY)
            await engine.wake_up(lambda: pytest.fail("level 1 keeps the weights"))
            assert (await last("awake", GREEDY)).outputs[0].finish_reason in ("length", "stop")
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_a_request_whose_client_leaves_while_held_never_runs(make_tiny_engine) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(make_tiny_engine())
        try:
            await engine.pause("wait")

            async def first_output() -> None:
                async for _ in engine.generate(PROMPT, GREEDY, "gone"):
                    return

            waiting = asyncio.create_task(first_output())
            await asyncio.sleep(0.1)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await engine.resume()
            await asyncio.sleep(0.1)
            assert engine.is_idle() and engine.stats().num_prompt_tokens == 0
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_artifacts_whose_weights_cannot_be_replaced_are_named() -> None:
    from kiln.runtime.live_weights import WeightUpdateError, check_refittable

    check_refittable({}, {"backend": "tvm"})
    for manifest, entry, why in (
        ({"vision": {}}, {"backend": "tvm"}, "vision-language"),
        ({}, {"backend": "tensorrt"}, "TensorRT engines hold their weights"),
    ):
        with pytest.raises(WeightUpdateError, match=why):
            check_refittable(manifest, entry)
