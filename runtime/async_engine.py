"""AsyncEngine: the engine loop on a background thread, each request's outputs streamed to asyncio.

The event loop never runs a step: `generate()` hands the request to the loop thread through a command
queue and awaits an asyncio.Queue that the thread fills with `call_soon_threadsafe`. Leaving the
generator early (a client disconnecting) aborts the request, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(KilnError):
    """The engine loop failed; no request can be served."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self._on_step: list[Callable[[list[RequestOutput]], None]] = []
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    def add_step_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        """Called on the loop thread after every step (metrics)."""
        self._on_step.append(listener)

    async def generate(
        self, prompt: str | Seq[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are made, the last one with `finished` set.

        Raises ValueError at once (before yielding) for a prompt or parameters that cannot be served.
        """
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead}")
        request_id = request_id or uuid.uuid4().hex
        token_ids, _ = self.engine.validate(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        prompt_text = prompt if isinstance(prompt, str) else None
        self._submit(lambda: self._add(request_id, prompt_text, token_ids, params))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, token_ids, params)
            if prompt is not None:
                self.engine.requests[request_id].prompt = prompt
        except ValueError as error:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # the step itself failed: every stream learns why, then stop
                logger.exception("engine step failed")
                self.dead = error
                for stream in list(self._streams.values()):
                    stream.put(EngineDeadError(f"the engine step failed: {error}"))
                return
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
            for listener in self._on_step:
                listener(outputs)

    def is_idle(self) -> bool:
        return not self.engine.has_unfinished_requests() and self._commands.empty()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "kv_cache_usage": engine.kv_cache_usage,
        }
