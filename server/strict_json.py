"""Request bodies as strict JSON: UTF-8 only, and no string holding a lone UTF-16 surrogate.

Python's JSON reader takes both (invalid UTF-8 bytes of a surrogate through `surrogatepass`, and
`"\\ud800"` escapes), but such a string is no text: echoed into a response (an unknown `model`,
`metadata`) it cannot be encoded and the request would fail with a 500. Refused here, it is the same 400
as any malformed body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


def loads(body: bytes) -> Any:
    """The JSON value of `body`; json.JSONDecodeError for anything but UTF-8 JSON of real text."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise json.JSONDecodeError(f"invalid UTF-8 ({error.reason})", repr(body[:80]), error.start) from None
    value = json.loads(text)
    _check_text(value, text)
    return value


def _check_text(value: Any, text: str) -> None:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                surrogate = f"\\u{ord(item[error.start]):04x}"
                position = max(text.lower().find(surrogate), 0)
                raise json.JSONDecodeError(
                    f"a string holds the lone surrogate {surrogate}, which is not text", text, position
                ) from None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is read by `loads`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
