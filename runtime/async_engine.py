"""AsyncEngine: the engine loop on a background thread, each request's outputs streamed to asyncio.

The event loop never runs a step: `generate()` hands the request to the loop thread through a command
queue and awaits an asyncio.Queue that the thread fills, a step's outputs for every stream in one
`call_soon_threadsafe` (one wake-up of the event loop a step, however many streams). Leaving the
generator early (a client disconnecting) aborts the request, which frees its blocks at once.

Any failure on the loop thread (a step, a command, a listener) other than a ValueError refusing one
request stops the engine: `dead` is set, every stream in flight raises EngineDeadError, and so does
every later `generate`. `shutdown` stops the engine the same way.

What a server needs of the engine is here, safe to call from any thread: the settings fixed at start,
`validate`, `compile_grammar` and `stats`; LoRA adapters are read off the loop and registered on it.

Weights change and the engine sleeps only between requests (runtime/live_weights.py): `pause` holds new
requests back (their `add` waits in `_held_adds`) until `resume`, new weights are made off the loop and
swapped in on it once nothing is in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from kiln.backends.base import Executable
from kiln.errors import KilnError
from kiln.runtime.engine import LLMEngine
from kiln.runtime.kv_offload import OffloadStats
from kiln.runtime.live_weights import (
    PAUSE_MODES,
    EngineAsleepError,
    PauseMode,
    StagedWeights,
    WeightVersion,
)
from kiln.runtime.lora import LoRAError, LoRARequest
from kiln.runtime.memory import return_freed_memory
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.pooling import PoolingParams, PoolingType
from kiln.runtime.sampling_params import SamplingParams, StructuredOutput
from kiln.runtime.speculative.decoder import SpeculativeStats
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.vision import ImageEmbedding, VisionModel

logger = logging.getLogger(__name__)


class EngineDeadError(KilnError):
    """The engine loop failed; no request can be served."""


_Queue = asyncio.Queue[RequestOutput | BaseException]


def _put_all(items: list[tuple[_Queue, RequestOutput]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: _Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the stream's event loop has closed: no one is left to tell
            pass


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """The engine's gauges and counters, as `AsyncEngine.stats` read them."""

    num_running: int  # sequences in the batch
    num_waiting: int
    kv_cache_usage: float  # fraction of KV-cache blocks in use
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    speculative: SpeculativeStats | None  # None: speculative decoding is off
    prefix_cache_queries: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, tokens found there
    requests_by_adapter: dict[str, int] = field(default_factory=dict)  # with LoRA: "" for the base model
    weight_updates: dict[tuple[str, str], int] = field(default_factory=dict)  # (how, outcome) → count
    kv_offload: OffloadStats | None = None  # None: no offload tiers


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()  # a stream is registered before death or learns of it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._on_step: list[Callable[[list[RequestOutput]], None]] = []
        self._paused = False
        self._held_adds: list[Callable[[], None]] = []  # requests that arrived while paused
        self._idle_waiters: list[concurrent.futures.Future[None]] = []
        self._weights_lock: asyncio.Lock | None = None  # one update, sleep or wake-up at a time
        self._weight_source = "artifact"  # where the served weights came from
        self._weight_updates: dict[tuple[str, str], int] = {}  # (how, "ok" | "failed") → count
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    # -- what the engine was started with (fixed, so read from any thread) ----------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def input_modalities(self) -> tuple[str, ...]:
        return self._engine.input_modalities

    @property
    def vision(self) -> VisionModel | None:
        """A vision-language model's image encoder (any thread may embed with it)."""
        return self._engine.vision

    @property
    def max_num_seqs(self) -> int:
        return self._engine.scheduler.config.max_num_seqs

    @property
    def pooling(self) -> PoolingType:
        """How an embedding request pools (EngineConfig.pooling)."""
        return self._engine.config.pooling

    def check_embeds(self) -> int:
        """The width of the model's embeddings; a ValueError where it cannot embed (LLMEngine)."""
        return self._engine.check_embeds()

    def check_priority(self, priority: int) -> None:
        """A ValueError for a priority the scheduling policy would ignore; reads only the settings."""
        self._engine.scheduler.config.check_priority(priority)

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped; None while it serves."""
        return self._dead

    def validate(self, prompt: str | Seq[int], params: SamplingParams) -> tuple[list[int], int]:
        """The prompt's token ids and its max_tokens, or a ValueError saying what does not fit; reads
        only the engine's settings, so any thread may ask."""
        return self._engine.validate(prompt, params)

    def compile_grammar(self, constraint: StructuredOutput) -> None:
        """Compile `constraint` (once: compiled grammars are cached), blocking the calling thread; a
        GrammarError says why it does not compile."""
        self._engine.grammars.compile(constraint)

    def add_step_listener(self, listener: Callable[[list[RequestOutput]], None]) -> None:
        """Called on the loop thread after every step (metrics)."""
        self._on_step.append(listener)

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        images: Seq[ImageEmbedding] = (),
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are made, the last one with `finished` set. `images`: a
        vision-language model's, embedded (runtime/vision.py), in prompt order. `lora_request`: a
        registered adapter's (`add_lora`). `pooling`: an embedding request (one output, its vector).

        Raises ValueError at once (before yielding) for a prompt or parameters that cannot be served.
        """
        self._raise_if_dead()
        if self._engine.asleep:
            raise EngineAsleepError(
                f"the engine sleeps (level {self._engine.asleep}): no request can start",
                hint="POST /wake_up first",
            )
        request_id = request_id or uuid.uuid4().hex
        if images:
            prompt, _ = self._engine.place_images(prompt, images)
        token_ids, _ = self.validate(prompt, params)
        self.check_priority(priority)
        if params.structured_output is not None:  # compiled off the engine loop; a GrammarError is a 400
            await asyncio.wrap_future(self._engine.grammars.submit(params.structured_output))
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        prompt_text = prompt if isinstance(prompt, str) else None
        self._submit(
            lambda: self._add_or_hold(
                lambda: self._add(
                    request_id, prompt_text, token_ids, params, priority, images, lora_request, pooling
                )
            )
        )
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
        self._submit(lambda: self._engine.abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _add_or_hold(self, add: Callable[[], None]) -> None:
        if self._paused:
            self._held_adds.append(add)
        else:
            add()

    def _add(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        images: Seq[ImageEmbedding],
        lora_request: LoRARequest | None,
        pooling: PoolingParams | None,
    ) -> None:
        if request_id not in self._streams:  # its client left while it was held by a pause
            return
        try:
            if lora_request is not None and self.find_lora(lora_request.lora_name) is None:
                raise ValueError(f"model {lora_request.lora_name!r}: the adapter was unloaded")
            self._engine.add_request(request_id, token_ids, params, priority, images, lora_request, pooling)
            if prompt is not None:
                self._engine.requests[request_id].prompt = prompt
        except (ValueError, LoRAError) as error:  # an adapter unloaded since the request was checked
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error if isinstance(error, ValueError) else ValueError(error.one_line()))

    # -- weights, pause and sleep (runtime/live_weights.py) ------------------------------------------

    @property
    def weight_version(self) -> WeightVersion:
        return WeightVersion(self._engine.weight_version, self._weight_source)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> int:
        """The sleep level: 0 awake, 1 without a KV cache, 2 without weights too."""
        return self._engine.asleep

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Start no new request until `resume`; returns once none is in flight: `wait` lets them finish,
        `abort` ends them now (each stream gets its last output, finish_reason "abort")."""
        if mode not in PAUSE_MODES:
            raise ValueError(
                f"pause mode {mode!r} is not supported; give one of {', '.join(PAUSE_MODES)} (keep is "
                "refused: a kept request would hold tokens of two weight versions)"
            )

        def start_pause() -> None:
            self._paused = True
            if mode == "abort":
                self._deliver(self._engine.abort_all())

        await self._on_engine_thread(start_pause)
        idle: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(lambda: self._idle_waiters.append(idle))
        await asyncio.wrap_future(idle)

    async def resume(self) -> None:
        """Start the requests held by `pause`, and every later one."""

        def release() -> None:
            self._paused = False
            held, self._held_adds = self._held_adds, []
            for add in held:
                add()

        await self._on_engine_thread(release)

    async def replace_weights(
        self, make: Callable[[], Executable | StagedWeights], how: str, source: str
    ) -> WeightVersion:
        """Make an executable with the new weights (in a worker thread: the engine keeps serving), then,
        with no request in flight (pausing in `wait` mode unless paused already), serve it; `make`'s
        error leaves the served weights as they are. `how` counts it in `weight_updates`."""
        async with self._lock():
            try:
                executable = await asyncio.to_thread(make)
                version = await self._swap(executable, source)
            except BaseException:
                self.count_weight_update(how, "failed")
                return_freed_memory()  # what was made of the refused weights
                raise
            self.count_weight_update(how, "ok")
            return version

    async def _swap(self, executable: Executable | StagedWeights, source: str) -> WeightVersion:
        was_paused = self._paused
        if not was_paused:
            await self.pause("wait")
        try:

            def swap() -> None:
                new = executable.commit() if isinstance(executable, StagedWeights) else executable
                self._engine.replace_executable(new, self._engine.weight_version + 1)
                self._weight_source = source
                return_freed_memory()  # the old executable and the mapped files it was made from

            await self._on_engine_thread(swap)
        finally:
            if not was_paused:
                await self.resume()
        return self.weight_version

    def count_weight_update(self, how: str, outcome: str) -> None:
        key = (how, outcome)
        self._weight_updates[key] = self._weight_updates.get(key, 0) + 1

    async def sleep(self, level: int) -> None:
        """Pause (`wait`), then hand back the KV cache (level 1) and the weights too (level 2); requests
        that arrive while asleep are refused (EngineAsleepError), held ones wait for `wake_up`."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self._engine.executable.sleeps:
            raise ValueError(
                "this model's executable cannot sleep (a tensor-parallel model's workers hold their own "
                "KV caches and weights)"
            )
        async with self._lock():
            if not self._paused:
                await self.pause("wait")

            def hand_back() -> None:
                self._engine.sleep(level)
                return_freed_memory()  # the KV cache (and the weights)

            await self._on_engine_thread(hand_back)

    async def wake_up(self, reload: Callable[[], Executable]) -> None:
        """The KV cache again and, where a level-2 sleep dropped them and no update came since, the
        weights `reload` makes (a new weight version); then resume."""
        async with self._lock():
            if not self._engine.asleep:
                return
            if self._engine.weights_dropped:
                await self._swap(await asyncio.to_thread(reload), "artifact")
            await self._on_engine_thread(self._engine.wake_up)
            await self.resume()

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    # -- LoRA adapters ------------------------------------------------------------------------------

    @property
    def serves_lora(self) -> bool:
        return self._engine.adapters is not None

    def find_lora(self, name: str) -> LoRARequest | None:
        """The registered adapter called `name` (any thread may ask)."""
        adapters = self._engine.adapters
        return adapters.find(name) if adapters is not None else None

    def lora_adapters(self) -> list[LoRARequest]:
        adapters = self._engine.adapters
        return (
            [adapter.request for adapter in list(adapters.adapters.values())] if adapters is not None else []
        )

    async def add_lora(self, request: LoRARequest) -> None:
        """Read and check the adapter (in a worker thread), then register it on the engine's; a
        LoRAError says why it cannot be served."""
        adapters = self._engine.lora_slots()
        if adapters.find(request.lora_name) is not None:
            raise LoRAError(f"adapter {request.lora_name!r} is loaded already", hint="unload it first")
        adapter = await asyncio.to_thread(adapters.read, request)
        await self._on_engine_thread(lambda: adapters.add(adapter))

    async def remove_lora(self, name: str) -> None:
        """Unregister adapter `name`; a LoRAError while requests use it, or for an unknown name."""
        await self._on_engine_thread(lambda: self._engine.remove_lora(name))

    async def _on_engine_thread(self, command: Callable[[], Any]) -> Any:
        """Run `command` between steps, on the engine's thread; its result or its error."""
        self._raise_if_dead()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(command())
            except BaseException as error:
                done.set_exception(error)

        self._submit(run)
        return await asyncio.wrap_future(done)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        """A new error each time: one instance raised in several streams would pile up tracebacks."""
        if isinstance(self._dead, EngineDeadError):
            return EngineDeadError(str(self._dead))
        return EngineDeadError(f"the engine loop failed: {type(self._dead).__name__}: {self._dead}")

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
            if not self._engine.has_unfinished_requests():
                self._tell_idle()
                self._wake.wait(timeout=0.5)
                continue
            outputs = self._engine.step()
            self._deliver(outputs)
            for listener in self._on_step:
                listener(outputs)

    def _tell_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one hand-off to each event loop, however many streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.outputs, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: no one is left to tell
                pass

    def _stop_serving(self, reason: BaseException) -> None:
        """Mark the engine dead and fail every stream; commands still queued never run."""
        with self._streams_lock:
            self._dead = reason
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(self._dead_error())
        for waiter in self._idle_waiters:
            waiter.set_exception(self._dead_error())

    def is_idle(self) -> bool:
        return not self._engine.has_unfinished_requests() and self._commands.empty()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread, waiting at most `timeout` seconds for its step in progress."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.1f s (a step may be stuck)", timeout)

    def stats(self) -> EngineStatsSnapshot:
        """Read from any thread while the loop thread changes them; a gauge that cannot be read (the
        loop thread keeps changing what it counts) reads 0."""
        engine = self._engine
        num_running, num_waiting, kv_cache_usage = self._gauges()
        counters = engine.stats
        return EngineStatsSnapshot(
            num_running,
            num_waiting,
            kv_cache_usage,
            counters.num_prompt_tokens,
            counters.num_generation_tokens,
            engine.scheduler.num_preemptions,
            counters.speculative.copy() if engine.spec_decoder is not None else None,
            engine.scheduler.num_prefix_cache_queried_tokens,
            engine.scheduler.num_prefix_cache_hit_tokens,
            dict(engine.adapters.requests_by_adapter) if engine.adapters is not None else {},
            dict(self._weight_updates),
            engine.offload_stats(),
        )

    def _gauges(self) -> tuple[int, int, float]:
        engine = self._engine
        for _ in range(10):
            try:
                return engine.num_running, engine.num_waiting, engine.kv_cache_usage
            except RuntimeError:  # a dict changed size while counted: read again
                continue
        return 0, 0, 0.0
