"""A limit on request bodies: 413 in OpenAI's error shape for a body over `max_bytes`, before the server
parses or tokenizes any of it.

A declared Content-Length over the limit is refused before the body is read; a chunked body is counted
as it arrives and refused once it grows past the limit.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.errors import request_too_large

MIN_MAX_REQUEST_BYTES = 16 * 1024 * 1024
BYTES_PER_CONTEXT_TOKEN = 64  # generous: a JSON-escaped token of text, or a token id and its comma


def default_max_request_bytes(max_model_len: int) -> int:
    """16 MiB, or more where the context is long enough that a full prompt might need it."""
    return max(MIN_MAX_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * max_model_len)


class BodyTooLarge(Exception):
    """Raised from `receive` once the body has grown past the limit, to stop the app reading it."""


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = request_too_large(self.max_bytes).response()
        if _content_length(scope) > self.max_bytes:
            await refusal(scope, receive, send)
            return
        received = 0
        too_large = started = refused = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise BodyTooLarge(f"the request body is over {self.max_bytes} bytes")
            return message

        async def checked_send(message: Message) -> None:
            nonlocal started, refused
            if too_large and not started:
                # The app answers a body it could not read (FastAPI makes that a 400): answer 413 instead.
                if not refused:
                    refused = True
                    await refusal(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, checked_send)
        except BodyTooLarge:
            if started:
                raise
            if not refused:
                await refusal(scope, receive, send)


def _content_length(scope: Scope) -> int:
    """The declared body size; -1 where none (or no valid one) is declared."""
    try:
        return int(Headers(scope=scope).get("content-length", -1))
    except ValueError:
        return -1
