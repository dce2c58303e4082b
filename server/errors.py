"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, whatever went wrong; on
Anthropic's routes (/v1/messages…) in Anthropic's: `{"type": "error", "error": {"type", "message"}}`, the
message naming the field, with the same status.

Every invalid field is a 400 that names the field in `param` (FastAPI's 422 is mapped here), a missing
or wrong key 401, an unknown model 404, a body over the size limit 413, too many waiting requests 503.
An unexpected exception is a 500 with the same shape, logged; it never stops the server.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from kiln.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
OVERLOADED = "overloaded_error"

ANTHROPIC_ROUTES = "/v1/messages"

# pydantic names union members and some constraints in an error's location; they are not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}
_FIELD_NAME = re.compile(r"^([a-z_][a-z0-9_]*) ")


class APIError(Exception):
    """Raised anywhere while serving a request; becomes an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        message = self.message
        if self.param is not None and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": self.anthropic_type(), "message": message}}

    def anthropic_type(self) -> str:
        if self.type == OVERLOADED:
            return OVERLOADED
        by_status = {401: AUTHENTICATION, 404: NOT_FOUND, 413: "request_too_large"}
        return by_status.get(self.status, INVALID_REQUEST if self.status < 500 else "api_error")

    def response(self) -> JSONResponse:
        return _ErrorResponse(self)


class _ErrorResponse(JSONResponse):
    """An APIError in the shape of the API whose route was asked for, chosen when it is sent: the
    middleware that answers before routing (the API key, the body limit) passes only the scope."""

    def __init__(self, error: APIError) -> None:
        self.error = error
        super().__init__(error.body(), status_code=error.status, headers=self._headers())

    def _headers(self) -> dict[str, str] | None:
        return {"WWW-Authenticate": "Bearer"} if self.error.status == HTTPStatus.UNAUTHORIZED else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_anthropic_route(scope.get("path", "")):
            anthropic = JSONResponse(self.error.anthropic_body(), self.status_code, self._headers())
            await anthropic(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def is_anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(f"{ANTHROPIC_ROUTES}/")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, INVALID_REQUEST, param, code)


def from_value_error(error: ValueError, param: str | None = None) -> APIError:
    """A 400 for a ValueError from the runtime, whose messages start with the field's name
    ("temperature must be >= 0, got -1.0"); `param` overrides that guess."""
    message = str(error)
    if param is None:
        match = _FIELD_NAME.match(message)
        param = match.group(1) if match else None
    return bad_request(message, param)


def not_found_model(model: str) -> APIError:
    return APIError(
        HTTPStatus.NOT_FOUND,
        f"The model `{model}` does not exist.",
        INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def unauthorized() -> APIError:
    return APIError(
        HTTPStatus.UNAUTHORIZED,
        "Missing or incorrect API key; send it as `Authorization: Bearer <key>` or `x-api-key: <key>`.",
        AUTHENTICATION,
        code="invalid_api_key",
    )


def request_too_large(max_bytes: int) -> APIError:
    return APIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"The request body is larger than this server's limit of {max_bytes} bytes (--max-request-bytes); "
        "send a shorter prompt or split the request.",
        INVALID_REQUEST,
        code="request_too_large",
    )


def overloaded(message: str) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, OVERLOADED, code="overloaded")


def engine_unavailable(message: str) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, SERVER_ERROR, code="engine_dead")


def engine_asleep(message: str) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, SERVER_ERROR, code="engine_asleep")


def validation_param(loc: Sequence[str | int]) -> str | None:
    """`('body', 'messages', 0, 'role')` → `messages[0].role`; union tags and model names are skipped."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    if not parts or not isinstance(parts[0], str):
        return None
    param = parts[0]
    for part in parts[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part.islower() and part not in _TYPE_TAGS:
            param += f".{part}"
        else:
            break
    return param


def from_validation_error(error: RequestValidationError) -> APIError:
    errors = list(error.errors())
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        position = first["loc"][-1] if first.get("loc") else "?"
        return bad_request(f"The request body is not valid JSON: {reason} (at character {position}).")
    param = validation_param(first.get("loc", ()))
    if param is None:
        if first.get("type") == "missing":
            return bad_request("The request needs a JSON body.")
        return bad_request(f"The request body must be a JSON object{_input_suffix(first)}.")
    # A field of a union type fails once per alternative: say so once.
    by_param: dict[str, list[dict[str, Any]]] = {}
    for item in errors:
        by_param.setdefault(validation_param(item.get("loc", ())) or "body", []).append(item)
    shown = []
    for where, items in list(by_param.items())[:3]:
        if len(items) == 1:
            shown.append(f"{where}: {items[0].get('msg', 'invalid')}{_input_suffix(items[0])}")
        else:
            shown.append(f"{where}: Input matches none of the accepted types{_input_suffix(items[0])}")
    more = f" (and {len(by_param) - 3} more fields)" if len(by_param) > 3 else ""
    return bad_request("; ".join(shown) + more, param)


def _input_suffix(item: dict[str, Any]) -> str:
    if item.get("type") == "missing" or "input" not in item:
        return ""
    try:
        text = json.dumps(item["input"])
    except (TypeError, ValueError):
        return ""
    return f", got {text}" if len(text) <= 60 else ""


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        api_error = from_validation_error(error)
        content_type = request.headers.get("content-type", "")
        if api_error.param is None and "json" not in content_type:
            message = f"Send the body as JSON, with Content-Type: application/json (not {content_type!r})."
            return bad_request(message).response()
        return api_error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        status = error.status_code
        kind = {404: NOT_FOUND, 401: AUTHENTICATION}.get(
            status, INVALID_REQUEST if status < 500 else SERVER_ERROR
        )
        message = str(error.detail)
        if status == HTTPStatus.NOT_FOUND:
            message = f"No route {request.method} {request.url.path}."
        return APIError(status, message, kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal error: {type(error).__name__}", SERVER_ERROR
        ).response()
