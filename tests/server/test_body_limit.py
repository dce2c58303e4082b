"""A body over max_request_bytes is a 413 in OpenAI's error shape, declared or chunked, and the server
serves on; in process, on the tiny model."""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.server.body_limit import MIN_MAX_REQUEST_BYTES, default_max_request_bytes

LIMIT = 64 * 1024
JSON = {"Content-Type": "application/json"}


def _oversized_body(model: str) -> bytes:
    body = json.dumps({"model": model, "prompt": "w5 " * LIMIT, "max_tokens": 1}).encode()
    assert len(body) > LIMIT
    return body


def _chunks(body: bytes, size: int = 8192):
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"{LIMIT} bytes" in error["message"]


def test_a_declared_body_over_the_limit_is_413(start_app) -> None:
    server = start_app(max_request_bytes=LIMIT)
    body = _oversized_body("tiny")
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=JSON, timeout=30)
    assert response.request.headers["content-length"] == str(len(body))
    _assert_413(response)
    _assert_still_serving(server.url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_chunked_body_growing_past_the_limit_is_413(start_app, path: str) -> None:
    server = start_app(max_request_bytes=LIMIT)
    body = _oversized_body("tiny")
    response = httpx.post(f"{server.url}{path}", content=_chunks(body), headers=JSON, timeout=30)
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    _assert_413(response)
    _assert_still_serving(server.url)


def test_a_body_under_the_limit_is_served_declared_or_chunked(start_app) -> None:
    server = start_app(max_request_bytes=LIMIT)
    body = json.dumps({"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 2}).encode()
    for content in (body, _chunks(body, size=4)):
        response = httpx.post(f"{server.url}/v1/completions", content=content, headers=JSON, timeout=30)
        assert response.status_code == 200, response.text


def test_the_key_is_checked_before_the_size(start_app) -> None:
    server = start_app(api_key="sk-test", max_request_bytes=LIMIT)
    response = httpx.post(
        f"{server.url}/v1/completions", content=_oversized_body("tiny"), headers=JSON, timeout=30
    )
    assert response.status_code == 401


def test_the_default_limit_grows_with_the_context() -> None:
    assert default_max_request_bytes(8192) == MIN_MAX_REQUEST_BYTES == 16 * 2**20
    assert default_max_request_bytes(1_048_576) == 64 * 1_048_576


def test_a_limit_below_one_byte_is_refused(start_app) -> None:
    with pytest.raises(ValueError, match="max_request_bytes must be >= 1"):
        start_app(max_request_bytes=0)


def _assert_still_serving(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2, response.text
