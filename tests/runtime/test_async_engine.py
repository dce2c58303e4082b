"""AsyncEngine: streams match the sync engine, the event loop stays free, leaving early aborts, and any
failure of the loop thread fails every stream and every later request at once."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from kiln.runtime.async_engine import AsyncEngine, EngineDeadError
from kiln.runtime.engine import LLMEngine
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return [2 + (i * 7 + j) % 90 for j in range(5 + 3 * i)]


def test_streams_match_the_sync_engine(make_tiny_engine) -> None:
    sync = make_tiny_engine()
    for i in range(6):
        sync.add_request(f"r{i}", _prompt(i), PARAMS)
    expected = {o.request_id: o.outputs[0] for o in sync.run_to_completion()}
    engine = AsyncEngine(make_tiny_engine())

    async def one(i: int) -> tuple[list[int], str, str]:
        deltas, last = [], None
        async for output in engine.generate(_prompt(i), PARAMS, request_id=f"r{i}"):
            deltas.append(output.outputs[0].delta_text)
            last = output
        assert last is not None and last.finished
        return last.outputs[0].token_ids, "".join(deltas), last.outputs[0].text

    async def main() -> list[tuple[list[int], str, str]]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    try:
        for i, (tokens, streamed, text) in enumerate(asyncio.run(main())):
            assert tokens == expected[f"r{i}"].token_ids
            assert streamed == text == expected[f"r{i}"].text
    finally:
        engine.shutdown()


def test_a_step_hands_its_outputs_to_the_event_loop_at_once(make_tiny_engine) -> None:
    sync = make_tiny_engine()
    engine = AsyncEngine(sync)
    handoffs = 0

    async def main() -> None:
        nonlocal handoffs
        loop = asyncio.get_running_loop()
        schedule = loop.call_soon_threadsafe

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal handoffs
            handoffs += 1
            return schedule(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        async def one(i: int) -> None:
            async for _ in engine.generate(_prompt(i), PARAMS, request_id=f"r{i}"):
                pass

        await asyncio.gather(*(one(i) for i in range(6)))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert 0 < handoffs <= sync.stats.num_steps  # one a step, not one a stream a step


def test_the_event_loop_is_not_blocked(make_tiny_engine) -> None:
    engine = AsyncEngine(make_tiny_engine())
    ticks: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        await asyncio.gather(*(_drain(engine.generate(_prompt(i), long)) for i in range(4)))
        stop.set()
        await task

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 10 and max(gaps) < 0.5


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_leaving_the_stream_aborts_and_frees_blocks(make_tiny_engine) -> None:
    sync_engine = make_tiny_engine()
    engine = AsyncEngine(sync_engine)

    async def main() -> None:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for output in engine.generate(_prompt(3), long, request_id="gone"):
            if len(output.outputs[0].token_ids) >= 3:
                break
        for _ in range(200):
            if engine.is_idle():
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert engine.is_idle()
        assert sync_engine.kv.pool.num_free == sync_engine.kv.pool.num_usable
        assert "gone" not in sync_engine.requests
    finally:
        engine.shutdown()


def test_a_bad_request_raises_before_streaming(make_tiny_engine) -> None:
    engine = AsyncEngine(make_tiny_engine())

    async def main() -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await _drain(engine.generate(list(range(2, 90)) * 4, PARAMS))

    try:
        asyncio.run(main())
        assert engine.is_idle()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig(num_speculative_tokens=3)])
def test_what_a_server_reads(make_tiny_engine, speculative: SpeculativeConfig | None) -> None:
    """The settings, validation and a stats snapshot (speculative counters only when speculating)."""
    sync_engine = make_tiny_engine(max_num_seqs=3, speculative=speculative)
    engine = AsyncEngine(sync_engine)
    try:
        assert engine.tokenizer is sync_engine.tokenizer
        assert (engine.max_model_len, engine.max_num_seqs) == (sync_engine.max_model_len, 3)
        assert engine.validate(_prompt(1), PARAMS) == (_prompt(1), PARAMS.max_tokens)
        before = engine.stats()
        asyncio.run(_drain(engine.generate(_prompt(1) * 2, PARAMS)))
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        assert stats.num_prompt_tokens == 2 * len(_prompt(1))
        assert stats.num_generation_tokens == PARAMS.max_tokens
        if speculative is None:
            assert before.speculative is None and stats.speculative is None
        else:
            assert before.speculative is not None and stats.speculative is not None
            assert before.speculative.num_drafts == 0 < stats.speculative.num_drafts
            assert stats.speculative == sync_engine.stats.speculative
    finally:
        engine.shutdown()


STREAM_TIMEOUT_S = 10.0  # a stream the dead engine forgot would wait forever: fail instead
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


def _add_fails_with(error: Exception) -> type[LLMEngine]:
    """Fault injection: an engine whose add_request raises `error` for request "boom"."""

    class AddFails(LLMEngine):
        def add_request(
            self,
            request_id: str,
            prompt: str | Seq[int],
            params: SamplingParams | None = None,
            priority: int = 0,
            images: Seq[Any] = (),
            lora_request: Any = None,
            pooling: Any = None,
        ) -> None:
            if request_id == "boom":
                raise error
            super().add_request(request_id, prompt, params, priority, images, lora_request, pooling)

    return AddFails


class _AbortFails(LLMEngine):
    """Fault injection: aborting a request raises RuntimeError."""

    def abort(self, request_id: str) -> bool:
        raise RuntimeError(f"cannot abort {request_id}")


async def _fails_dead(stream) -> EngineDeadError:
    with pytest.raises(EngineDeadError) as failed:
        await asyncio.wait_for(_drain(stream), STREAM_TIMEOUT_S)
    return failed.value


def _logged_failure(caplog: pytest.LogCaptureFixture, error_type: type[BaseException]) -> bool:
    return any(
        r.levelno == logging.ERROR and r.exc_info is not None and r.exc_info[0] is error_type
        for r in caplog.records
    )


def test_a_failing_step_fails_every_stream(make_tiny_engine, caplog) -> None:
    engine = AsyncEngine(make_tiny_engine(fail_at_step=6))

    async def main() -> None:
        streams = [engine.generate(_prompt(i), LONG) for i in range(3)]
        results = await asyncio.gather(*(_fails_dead(s) for s in streams))
        assert all("injected device fault" in str(error) for error in results)
        await _fails_dead(engine.generate(_prompt(0), PARAMS))

    try:
        asyncio.run(main())
        assert isinstance(engine.dead, RuntimeError)
        assert _logged_failure(caplog, RuntimeError)
    finally:
        engine.shutdown()


def test_a_failing_command_fails_every_stream_and_later_request(make_tiny_engine, caplog) -> None:
    """ "boom"'s add command raises KeyError while a stream is running and "queued"'s command waits
    behind it (a slow step holds the loop thread): all three fail, and so does every later request."""
    engine_class = _add_fails_with(KeyError("boom"))  # a bug, not a refusal of the request
    sync_engine = make_tiny_engine(step_delay_s=0.2, engine_class=engine_class)
    engine = AsyncEngine(sync_engine)

    async def main() -> None:
        running = engine.generate(_prompt(1), LONG, request_id="running")
        await asyncio.wait_for(anext(running), STREAM_TIMEOUT_S)
        boom = engine.generate(_prompt(2), PARAMS, request_id="boom")
        queued = engine.generate(_prompt(3), PARAMS, request_id="queued")
        errors = await asyncio.gather(_fails_dead(running), _fails_dead(boom), _fails_dead(queued))
        assert all("KeyError" in str(error) for error in errors)
        started = time.perf_counter()
        await _fails_dead(engine.generate(_prompt(4), PARAMS))
        assert time.perf_counter() - started < 0.1

    try:
        asyncio.run(main())
        assert isinstance(engine.dead, KeyError)
        assert "queued" not in sync_engine.requests  # its command never ran
        assert _logged_failure(caplog, KeyError)
    finally:
        engine.shutdown()


def test_a_failing_abort_fails_every_stream(make_tiny_engine, caplog) -> None:
    engine = AsyncEngine(make_tiny_engine(engine_class=_AbortFails))

    async def main() -> None:
        left = engine.generate(_prompt(1), LONG)
        await asyncio.wait_for(anext(left), STREAM_TIMEOUT_S)
        other = engine.generate(_prompt(2), LONG)
        await asyncio.wait_for(anext(other), STREAM_TIMEOUT_S)
        await left.aclose()  # leaving early aborts
        await _fails_dead(other)

    try:
        asyncio.run(main())
        assert isinstance(engine.dead, RuntimeError)
        assert _logged_failure(caplog, RuntimeError)
    finally:
        engine.shutdown()


def test_a_value_error_refuses_only_its_request(make_tiny_engine) -> None:
    """The engine refusing one request on the loop thread, or a request id in use, fails only it."""
    engine = AsyncEngine(make_tiny_engine(engine_class=_add_fails_with(ValueError("boom is refused"))))

    async def main() -> None:
        first = engine.generate(_prompt(1), PARAMS, request_id="same")
        await asyncio.wait_for(anext(first), STREAM_TIMEOUT_S)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.wait_for(_drain(engine.generate(_prompt(2), PARAMS, request_id="same")), 10)
        with pytest.raises(ValueError, match="boom is refused"):
            await asyncio.wait_for(_drain(engine.generate(_prompt(2), PARAMS, request_id="boom")), 10)
        await asyncio.wait_for(_drain(first), STREAM_TIMEOUT_S)
        await asyncio.wait_for(_drain(engine.generate(_prompt(3), PARAMS)), STREAM_TIMEOUT_S)

    try:
        asyncio.run(main())
        assert engine.dead is None
    finally:
        engine.shutdown()


def test_shutdown_waits_a_bounded_time_and_fails_the_streams(make_tiny_engine, caplog) -> None:
    sync_engine = make_tiny_engine(step_delay_s=1.0)
    engine = AsyncEngine(sync_engine)

    async def main() -> None:
        stream = engine.generate(_prompt(1), LONG)
        waiting = asyncio.create_task(_fails_dead(stream))
        deadline = time.monotonic() + 30
        while sync_engine.executable.calls == 0:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "no step started"
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        engine.shutdown(timeout=0.1)
        assert time.perf_counter() - started < 0.8  # the step in progress takes 1 s
        assert "did not stop within 0.1 s" in caplog.text
        assert "shut down" in str(await waiting)
        await _fails_dead(engine.generate(_prompt(2), PARAMS))

    asyncio.run(main())
    assert engine.dead is not None
