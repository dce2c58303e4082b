"""AsyncEngine: streams match the sync engine, the event loop stays free, leaving early aborts."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.sampling_params import SamplingParams

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
