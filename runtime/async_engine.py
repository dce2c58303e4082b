"""AsyncEngine: the engine loop on a background thread, each request's outputs streamed to asyncio.

The event loop never runs a step: `generate()` hands the request to the loop thread through a command
queue and awaits an asyncio.Queue that the thread fills with `call_soon_threadsafe`. Leaving the
generator early (a client disconnecting) aborts the request, which frees its blocks at once.

Any failure on the loop thread (a step, a command, a listener) other than a ValueError refusing one
request stops the engine: `dead` is set, every stream in flight raises EngineDeadError, and so does
every later `generate`. `shutdown` stops the engine the same way.
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
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the stream's event loop has closed: no one is left to tell
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()  # a stream is registered before death or learns of it
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
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        token_ids, _ = self.engine.validate(prompt, params)
        if params.structured_output is not None:  # compiled off the engine loop; a GrammarError is a 400
            await asyncio.wrap_future(self.engine.grammars.submit(params.structured_output))
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
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
            with self._streams_lock:
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

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        """A new error each time: one instance raised in several streams would pile up tracebacks."""
        if isinstance(self.dead, EngineDeadError):
            return EngineDeadError(str(self.dead))
        return EngineDeadError(f"the engine loop failed: {type(self.dead).__name__}: {self.dead}")

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as error:
            logger.exception("the engine loop failed; no request can be served")
            self._stop_serving(error)
        else:
            self._stop_serving(EngineDeadError("the engine was shut down"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before draining: a command queued from here on sets it again
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                continue
            outputs = self.engine.step()
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
            for listener in self._on_step:
                listener(outputs)

    def _stop_serving(self, reason: BaseException) -> None:
        """Mark the engine dead and fail every stream; commands still queued never run."""
        with self._streams_lock:
            self.dead = reason
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(self._dead_error())

    def is_idle(self) -> bool:
        return not self.engine.has_unfinished_requests() and self._commands.empty()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread, waiting at most `timeout` seconds for its step in progress."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.1f s (a step may be stuck)", timeout)

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "kv_cache_usage": engine.kv_cache_usage,
        }
