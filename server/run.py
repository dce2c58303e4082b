"""Serve an engine (or several models' router, server/router.py) with uvicorn until SIGTERM or Ctrl-C.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and lets the requests in flight finish for
up to `shutdown_timeout` seconds, then cancels the rest (a stuck request cannot hold the server up); the
engine loop is stopped last and the process exits 0. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.live_weights import WeightSource
from kiln.server.app import APIKeyMiddleware, create_app
from kiln.server.body_limit import MIN_MAX_REQUEST_BYTES, BodyLimitMiddleware
from kiln.server.router import ModelRouter
from kiln.server.serving_engine import MediaLimits

logger = logging.getLogger(__name__)


_GRACEFUL = (signal.SIGTERM, signal.SIGINT)


def _after_graceful_shutdown(signum: int, frame: FrameType | None) -> None:
    """uvicorn, once it has shut down gracefully, raises the signal that stopped it again for the
    handler it replaced; that handler is this one, so the process can exit 0."""


def run_server(
    engine: AsyncEngine,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int | None = None,
    log_level: str = "info",
    max_request_bytes: int | None = None,
    shutdown_timeout: float = 30.0,
    auto_tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    media: MediaLimits | None = None,
    allow_lora_updates: bool = False,
    weights: WeightSource | None = None,
) -> None:
    """`max_request_bytes` None: see `create_app`; `auto_tool_parser`: the tool-call parser of
    tool_choice "auto" (None: auto is refused); `allow_lora_updates`, `weights`: see `create_app`."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
    app = create_app(
        engine,
        served_model_name,
        api_key,
        max_waiting,
        max_request_bytes=max_request_bytes,
        auto_tool_parser=auto_tool_parser,
        reasoning_parser=reasoning_parser,
        media=media,
        allow_lora_updates=allow_lora_updates,
        weights=weights,
    )
    try:
        _serve_until_stopped(app, host, port, log_level, shutdown_timeout)
    finally:
        engine.shutdown()
    logger.info("kiln serve: stopped")


def run_router(
    router: ModelRouter,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    max_request_bytes: int = MIN_MAX_REQUEST_BYTES,
    shutdown_timeout: float = 30.0,
) -> None:
    """Serve several models (server/router.py) as `run_server` serves one; the API key and the body-size
    limit are checked before the router reads a body. Every loaded model is closed at the end."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app: ASGIApp = BodyLimitMiddleware(router, max_request_bytes)
    if api_key:
        app = APIKeyMiddleware(app, api_key)
    try:
        _serve_until_stopped(app, host, port, log_level, shutdown_timeout)
    finally:
        router.close()
    logger.info("kiln serve: stopped")


def _serve_until_stopped(app: ASGIApp, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    previous = {sig: signal.signal(sig, _after_graceful_shutdown) for sig in _GRACEFUL}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
