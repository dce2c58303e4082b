"""Bad requests get OpenAI-shaped errors with the right status, type and param; none is a 500 and none
stops the server. Raw HTTP, so that bodies the `openai` client would refuse to send can be sent."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # every test here needs the SmolLM2 server (~10 s to start)

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", -1, "temperature"),
        ("temperature", "hot", "temperature"),
        ("n", 0, "n"),
        ("n", 10**30, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("max_tokens", "5", "max_tokens"),
        ("max_tokens", 2.5, "max_tokens"),
        ("max_tokens", 10**30, "max_tokens"),
        ("top_p", 0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("min_p", 2, "min_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("frequency_penalty", -2.5, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("logprobs", 21, "logprobs"),
        ("logprobs", True, "logprobs"),
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"1000000": 1}, "logit_bias"),
        ("logit_bias", {"5": 101}, "logit_bias"),
        ("logit_bias", [1, 2], "logit_bias"),
        ("seed", 2**64, "seed"),
        ("stop", [""], "stop"),
        ("stop", 5, "stop"),
        ("stop_token_ids", [10**9], "stop_token_ids"),
        ("min_tokens", -1, "min_tokens"),
        ("echo", "yes", "echo"),
        ("stream", 1, "stream"),
        ("best_of", 3, "best_of"),
        ("suffix", "!", "suffix"),
        ("stream_options", {"include_usage": True}, "stream_options"),
        ("prompt", 5, "prompt"),
        ("prompt", [1, "a"], "prompt"),
        ("prompt", [], "prompt"),
        ("prompt", [[]], "prompt"),
        ("prompt", [-1], "prompt"),
        ("prompt", [10**12], "prompt"),
        ("model", 7, "model"),
        ("priority", 1, "priority"),  # the server runs the fcfs policy
    ],
)
def test_invalid_completion_fields_are_400(api_server, field: str, value: object, param: str) -> None:
    body = {"model": api_server.model, "prompt": PROMPT, "max_tokens": 2, field: value}
    assert_error(api_server.post("/v1/completions", json=body), 400, "invalid_request_error", param)


_IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",  # a text-only model
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, _IMAGE_PART]}]},
            "messages[0].content[1]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"priority": -1}, "priority"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
    ],
)
def test_invalid_chat_fields_are_400(api_server, changes: dict, param: str) -> None:
    body = {"model": api_server.model, "messages": MESSAGES, "max_tokens": 2, **changes}
    assert_error(api_server.post("/v1/chat/completions", json=body), 400, "invalid_request_error", param)


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt": "x",',
        b"{'prompt': 'x'}",
        b"",
        b"null",
        b"[1, 2]",
        b'"text"',
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b"\xff\xfe\x00",
        b"[" * 100_000,
    ],
)
def test_malformed_bodies_are_400(api_server, content: bytes) -> None:
    response = api_server.post(
        "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, "invalid_request_error")


def test_the_openai_client_sees_bad_requests(api_server) -> None:
    client = api_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=api_server.model, prompt=PROMPT, temperature=-1)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=api_server.model, messages=[], max_tokens=2)


def test_unknown_model_is_404(api_server) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/tokenize", {"prompt": PROMPT}),
    ):
        response = api_server.post(path, json={"model": "gpt-4", **body})
        error = assert_error(response, 404, "invalid_request_error", "model")
        assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api_server.client().completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert_error(api_server.post("/v1/nothing", json={}), 404, "not_found_error")


def test_prompt_longer_than_the_context_is_400(api_server) -> None:
    long_prompt = "word " * 1100  # the server's --max-model-len is 1024
    error = assert_error(
        api_server.post("/v1/completions", json={"prompt": long_prompt}),
        400,
        "invalid_request_error",
        "prompt",
    )
    assert error["code"] == "context_length_exceeded" and "1024" in error["message"]
    chat = {"messages": [{"role": "user", "content": long_prompt}]}
    assert_error(api_server.post("/v1/chat/completions", json=chat), 400, "invalid_request_error", "messages")
    room = {"prompt": PROMPT, "max_tokens": 1020}
    error = assert_error(
        api_server.post("/v1/completions", json=room), 400, "invalid_request_error", "max_tokens"
    )
    assert error["code"] == "context_length_exceeded"


def test_tokenize_and_detokenize_errors(api_server) -> None:
    assert_error(
        api_server.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "invalid_request_error", "tokens"
    )
    assert_error(
        api_server.post("/detokenize", json={"tokens": "abc"}), 400, "invalid_request_error", "tokens"
    )
    assert_error(api_server.post("/tokenize", json={}), 400, "invalid_request_error", "prompt")
    assert_error(
        api_server.post("/tokenize", json={"messages": []}), 400, "invalid_request_error", "messages"
    )


def test_the_server_survives_bad_input(api_server) -> None:
    for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("PUT", "/tokenize")):
        response = httpx.request(method, f"{api_server.url}{path}", timeout=10)
        assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{api_server.url}/health", timeout=10).status_code == 200
    out = api_server.client().completions.create(
        model=api_server.model, prompt=PROMPT, max_tokens=1, temperature=0
    )
    assert out.choices[0].text == " Paris"
    assert "Traceback" not in api_server.log()


def test_an_image_for_a_text_only_model_names_the_part(api_server) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, _IMAGE_PART]}]
    for path, body in (
        ("/v1/chat/completions", {"model": api_server.model, "messages": messages, "max_tokens": 2}),
        ("/tokenize", {"model": api_server.model, "messages": messages}),
    ):
        response = api_server.post(path, json=body)
        assert_error(response, 400, "invalid_request_error", "messages[0].content[1]")
        assert "takes text only" in response.json()["error"]["message"]
    models = httpx.get(f"{api_server.url}/v1/models", timeout=10).json()["data"]
    assert models[0]["input_modalities"] == ["text"]


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "\\ud800", "prompt": "Hi", "max_tokens": 1}',  # an escaped lone surrogate
        b'{"model": "\xed\xa0\x80", "prompt": "Hi", "max_tokens": 1}',  # its raw (invalid UTF-8) bytes
        b'{"prompt": "Hi \xff", "max_tokens": 1}',  # not UTF-8
    ],
)
def test_a_body_that_is_not_utf8_text_is_400(api_server, content: bytes) -> None:
    response = api_server.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert "not valid JSON" in response.json()["error"]["message"]
