"""Serve an engine with uvicorn until SIGTERM or Ctrl-C.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, lets every request in flight finish (no
time limit: a request that has started runs to its end), then returns; the engine loop is stopped last
and the process exits 0. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from kiln.runtime.async_engine import AsyncEngine
from kiln.server.app import create_app

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
) -> None:
    app = create_app(engine, served_model_name, api_key, max_waiting)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=None,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    previous = {sig: signal.signal(sig, _after_graceful_shutdown) for sig in _GRACEFUL}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.shutdown()
    logger.info("kiln serve: stopped")
