"""Several models behind one port, as llama-server's router mode serves them: an outer ASGI app that owns
the model table and hands each request to its model's own app (`create_app`'s, one engine each).

A model loads (compiling it first where the cache lacks it) on its first request, off the event loop,
one load at a time per model: concurrent first requests wait for the same load. With
`max_loaded_models`, loading one more unloads the least recently used model that has no request in
flight; where every loaded model is busy, the request waits for one to finish, and after
`busy_timeout_s` seconds is a 503 (`overloaded`). An unload stops the engine's loop, closes the model
and drops every reference to it, then collects garbage and trims the C heap, so its memory goes back to
the system. A model that fails to load answers that request with a 500 naming the reason (the next
request tries again); the server and the other models keep serving.

The router answers GET /v1/models (every model, with its `status`), /health (200 while it runs) and
/metrics (every loaded model's metrics, labelled by model_name) itself. Every other request goes to the
app of the model its JSON body's `model` names (the `model` query parameter for a request without a
body); the body is read here and replayed to that app.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.errors import KilnError
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.memory import return_freed_memory
from kiln.server import strict_json
from kiln.server.errors import SERVER_ERROR, APIError, bad_request, not_found_model, overloaded
from kiln.server.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_S = 60.0
ROUTER_PATHS = frozenset({"/v1/models", "/health", "/metrics"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

T = TypeVar("T")
ModelState = Literal["unloaded", "loading", "loaded", "unloading"]


@dataclass(frozen=True)
class ModelEntry:
    """A model the router serves: the name requests give as `model`, and what `kiln serve` was given for
    it (a known model name, a GGUF file, a HF directory or an artifact folder)."""

    name: str
    source: str


@dataclass
class ServedModel:
    """A loaded model: its engine, its app, and `close` (stops the engine loop, closes the model)."""

    app: FastAPI
    engine: AsyncEngine
    close: Callable[[], None]


ModelLoader = Callable[[ModelEntry], ServedModel]


class _Slot:
    """One model of the table: how to load it, and what is loaded of it now."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.state: ModelState = "unloaded"
        self.model: ServedModel | None = None
        self.transition: asyncio.Future[str | None] | None = None  # the load or unload under way
        self.in_flight = 0  # requests its app is serving
        self.waiting = 0  # requests waiting for it to load (it is not unloaded under them)
        self.last_used = 0.0
        self.error: str | None = None  # why its last load failed

    @property
    def idle(self) -> bool:
        return self.state == "loaded" and self.in_flight == 0 and self.waiting == 0


class ModelRouter:
    """The outer ASGI app of a several-model `kiln serve` (see the module doc). `load` runs on a thread
    of its own; `close()` closes every loaded model (after the server has stopped)."""

    def __init__(
        self,
        entries: list[ModelEntry],
        load: ModelLoader,
        *,
        max_loaded_models: int | None = None,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> None:
        if max_loaded_models is not None and max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1, got {max_loaded_models}")
        self._slots = {entry.name: _Slot(entry) for entry in entries}
        self._load_model = load
        self.max_loaded_models = max_loaded_models
        self.busy_timeout_s = busy_timeout_s
        self._changed = asyncio.Event()  # set (and replaced) whenever a model's state or use changes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] in ROUTER_PATHS and scope["method"] in ("GET", "HEAD"):
            response = await self._own_route(scope["path"])
            await response(scope, receive, send)
            return
        try:
            body = await _read_body(receive) if scope["method"] in BODY_METHODS else b""
            if body is None:  # the client left
                return
            name = self._requested_model(scope, body)
            slot = self._slots.get(name)
            if slot is None:
                raise not_found_model(name)
            model = await self._acquire(slot)
        except APIError as error:
            await error.response()(scope, receive, send)
            return
        try:
            # a copy: the app's own entries in the scope (itself, its routes) must not outlive the request
            await model.app(dict(scope), _replay(body, receive), send)
        finally:
            del model
            self._release(slot)

    # -- routing --------------------------------------------------------------------------------------

    def _requested_model(self, scope: Scope, body: bytes) -> str:
        """The `model` a request names; with a single model, a request may leave it out."""
        if body:
            try:
                fields = strict_json.loads(body)
            except json.JSONDecodeError as error:
                raise bad_request(f"The request body is not valid JSON: {error}.") from None
            model = fields.get("model") if isinstance(fields, dict) else None
            if model is not None and not isinstance(model, str):
                raise bad_request(f"model: Input should be a valid string, got {json.dumps(model)}", "model")
        else:
            model = next(iter(parse_qs(scope.get("query_string", b"").decode()).get("model", [])), None)
        if model is None:
            if len(self._slots) == 1:
                return next(iter(self._slots))
            raise bad_request(
                f"model: this server serves several models; name one of {', '.join(self._slots)}", "model"
            )
        return model

    async def _own_route(self, path: str) -> Response:
        if path == "/health":
            return Response(status_code=HTTPStatus.OK)
        if path == "/metrics":
            loaded = [slot.model for slot in self._slots.values() if slot.model is not None]
            registries = [model.app.state.metrics.registry for model in loaded]
            return Response(_merged_metrics(registries), media_type=CONTENT_TYPE)
        cards = [card for slot in list(self._slots.values()) for card in await self._cards(slot)]
        return JSONResponse({"object": "list", "data": cards})

    async def _cards(self, slot: _Slot) -> list[dict[str, Any]]:
        """The model's cards: a loaded model's as its app lists them (LoRA adapters too), with its status."""
        status: dict[str, Any] = {"value": slot.state}
        model = slot.model
        if model is None:
            if slot.error is not None:
                status |= {"failed": True, "message": slot.error}
            card = {"id": slot.entry.name, "object": "model", "created": int(time.time()), "owned_by": "kiln"}
            return [card | {"status": status}]
        if model.engine.dead is not None:
            status |= {"failed": True, "message": f"The engine has stopped: {model.engine.dead}"}
        slot.in_flight += 1  # not unloaded while its app answers (nor counted as a use)
        try:
            listed = await _get_json(model.app, "/v1/models")
        finally:
            del model
            slot.in_flight -= 1
            self._notify()
        return [card | {"status": status} for card in listed["data"]]

    # -- loading and unloading ------------------------------------------------------------------------

    async def _acquire(self, slot: _Slot) -> ServedModel:
        """The model loaded (loading it first, unloading another to make room), counted in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.busy_timeout_s
        slot.waiting += 1
        try:
            while True:
                if slot.state == "loaded" and slot.model is not None:
                    slot.in_flight += 1
                    slot.last_used = time.monotonic()
                    return slot.model
                if slot.transition is not None:
                    loading = slot.state == "loading"
                    failure = await asyncio.shield(slot.transition)
                    if loading and failure is not None:
                        raise _load_failed(slot.entry.name, failure)
                    continue
                if self._has_room():
                    self._begin(slot, "loading", self._load(slot))
                    continue
                # an unload under way makes room; only where none is does this request unload one
                victim = None if self._unloading() else self._least_recently_used_idle()
                if victim is not None:
                    self._begin(victim, "unloading", self._unload(victim))
                    continue
                changed, remaining = self._changed, deadline - loop.time()
                try:
                    await asyncio.wait_for(changed.wait(), max(remaining, 0))
                except TimeoutError:
                    raise overloaded(
                        f"The model `{slot.entry.name}` is not loaded, and each of the "
                        f"{self.max_loaded_models} loaded models (--max-loaded-models) kept serving requests "
                        f"for {self.busy_timeout_s:g} s; try again later."
                    ) from None
        finally:
            slot.waiting -= 1

    def _release(self, slot: _Slot) -> None:
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _has_room(self) -> bool:
        held = sum(slot.state != "unloaded" for slot in self._slots.values())
        return self.max_loaded_models is None or held < self.max_loaded_models

    def _unloading(self) -> bool:
        return any(slot.state == "unloading" for slot in self._slots.values())

    def _least_recently_used_idle(self) -> _Slot | None:
        idle = [slot for slot in self._slots.values() if slot.idle]
        return min(idle, key=lambda slot: slot.last_used, default=None)

    def _begin(self, slot: _Slot, state: ModelState, transition: Any) -> None:
        slot.state = state
        slot.transition = asyncio.ensure_future(transition)

    async def _load(self, slot: _Slot) -> str | None:
        """Load the model; None, or why it failed (kept for /v1/models)."""
        entry = slot.entry
        started = time.monotonic()
        try:
            model = await _on_own_thread(lambda: self._load_model(entry), f"kiln-load-{entry.name}")
        except Exception as error:
            slot.error = _reason(error)
            if not isinstance(error, KilnError | OSError | ValueError):
                logger.exception("loading model %s failed", entry.name)
            print(f"kiln: loading {entry.name} failed: {slot.error}", file=sys.stderr, flush=True)
            slot.state = "unloaded"
            return slot.error
        else:
            slot.model, slot.state, slot.error = model, "loaded", None
            slot.last_used = time.monotonic()
            took = slot.last_used - started
            print(f"kiln: loaded {entry.name} in {took:.1f} s", file=sys.stderr, flush=True)
            return None
        finally:
            slot.transition = None
            self._notify()

    async def _unload(self, slot: _Slot) -> str | None:
        held = [slot.model]
        slot.model = None
        try:
            await _on_own_thread(lambda: _close_and_free(held), f"kiln-unload-{slot.entry.name}")
            print(
                f"kiln: unloaded {slot.entry.name} (the least recently used of "
                f"{self.max_loaded_models} loaded models)",
                file=sys.stderr,
                flush=True,
            )
        except Exception:
            logger.exception("closing model %s failed", slot.entry.name)
        finally:
            slot.state, slot.transition = "unloaded", None
            self._notify()
        return None

    def close(self) -> None:
        """Close every loaded model (a load still under way is left to the process's exit)."""
        for slot in self._slots.values():
            model, slot.model, slot.state = slot.model, None, "unloaded"
            if model is not None:
                try:
                    model.close()
                except Exception:
                    logger.exception("closing model %s failed", slot.entry.name)


def _close_and_free(held: list[ServedModel | None]) -> None:
    """Close the model in `held` and let go of it; then hand the freed memory back to the system."""
    model = held.pop()
    try:
        if model is not None:
            model.close()
    finally:
        del model
        return_freed_memory()


async def _on_own_thread(work: Callable[[], T], name: str) -> T:
    """`work()` on a daemon thread: a load (or its compile) under way does not hold the process's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = work()
        except BaseException as raised:
            error = raised
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop has closed: the server has stopped
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


def _reason(error: BaseException) -> str:
    return error.one_line() if isinstance(error, KilnError) else f"{type(error).__name__}: {error}"


def _load_failed(name: str, reason: str) -> APIError:
    return APIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"The model `{name}` could not be loaded: {reason}",
        SERVER_ERROR,
        "model",
        "model_load_failed",
    )


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None where the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the model's app: the body already read, then what the client sends (a disconnect)."""
    replayed = False

    async def replaying() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying


async def _get_json(app: ASGIApp, path: str) -> Any:
    """A GET of `path` on `app`, in this process; its JSON body."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": None,
        "server": None,
    }
    chunks: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return json.loads(b"".join(chunks))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class _Merged(Collector):
    """The metric families of several registries, each family once, holding every registry's samples."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples += family.samples
        yield from families.values()


def _merged_metrics(registries: list[CollectorRegistry]) -> bytes:
    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Merged(registries))
    return generate_latest(merged)
