"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): shapes, stream events, tool
translation, counting, errors in Anthropic's shape and the x-api-key header on the tiny in-process app;
the `anthropic` client against the real SmolLM2 server (a message, a stream, a tool round trip)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from kiln.server.protocol_anthropic import MessagesRequest

VERSION = {"anthropic-version": "2023-06-01"}
HELLO = [{"role": "user", "content": "w5 w6 w7"}]
PLAIN = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "system": "w3 w4", "messages": HELLO}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_HISTORY = [
    {"role": "user", "content": "w5"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "w9", "signature": ""},
            {"type": "text", "text": "w6"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "w7"}]},
            {"type": "text", "text": "w8"},
            IMAGE,
        ],
    },
]


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=VERSION | (headers or {}), timeout=30)


def events_of(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; the name must be the data's type."""
    events = []
    for block in response.text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name, block
        events.append((name, data))
    return events


def assert_error(response: httpx.Response, status: int, kind: str, names: str | None = None) -> str:
    """An Anthropic-shaped error; `names`: what its message must name."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    message = body["error"]["message"]
    assert names is None or names in message, message
    return message


def test_a_message_and_its_stream(start_app) -> None:
    url = start_app().url
    reply = post(url, "/v1/messages", PLAIN)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["role"] == "assistant" and message["model"] == "tiny"
    (block,) = message["content"]
    assert block["type"] == "text" and block["text"]
    assert message["stop_reason"] in ("end_turn", "max_tokens") and message["stop_sequence"] is None
    counted = post(url, "/v1/messages/count_tokens", {k: PLAIN[k] for k in ("model", "system", "messages")})
    assert message["usage"] == {"input_tokens": counted.json()["input_tokens"], "output_tokens": 6}
    assert counted.json() == {"input_tokens": 5}  # the tiny template: "w3 w4 w5 w6 w7 "

    events = events_of(post(url, "/v1/messages", PLAIN | {"stream": True}))
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * (len(names) - 5) + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert events[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == block["text"]
    assert events[-2][1]["delta"] == {"stop_reason": message["stop_reason"], "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": 6}

    second_word = block["text"].split()[1]
    stopped = post(url, "/v1/messages", PLAIN | {"stop_sequences": [second_word]}).json()
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", second_word)


def test_tool_use_and_tool_result_turns_become_chat_messages() -> None:
    translation = MessagesRequest.model_validate(
        {
            "max_tokens": 4,
            "system": [{"type": "text", "text": "w3"}],
            "messages": TOOL_HISTORY,
            "tools": [WEATHER],
        }
    ).to_chat()
    chat = translation.request.model_dump(exclude_none=True)
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assistant, tool, user = chat["messages"][2:]
    assert assistant["content"] == [{"type": "text", "text": "w6"}]  # the thinking left out
    assert assistant["tool_calls"] == [
        {
            "id": "toolu_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert tool["tool_call_id"] == "toolu_1" and tool["content"] == [{"type": "text", "text": "w7"}]
    assert user["content"][0] == {"type": "text", "text": "w8"}
    assert user["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw0KGgo="
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert translation.param("messages[4].content[1]") == "messages[2].content[2]"
    assert translation.param("messages[3].content[0]") == "messages[2].content[0].content[0]"
    assert translation.param("stop") == "stop_sequences"


def test_a_tool_history_is_counted_and_answered(start_app) -> None:
    url = start_app().url
    history = [*TOOL_HISTORY[:2], {"role": "user", "content": TOOL_HISTORY[2]["content"][:2]}]
    asked = {"model": "tiny", "messages": history, "tools": [WEATHER]}
    counted = post(url, "/v1/messages/count_tokens", asked)
    assert counted.json() == {"input_tokens": 4}, counted.text  # "w5 w6 w7 w8 ": the template shows contents
    reply = post(url, "/v1/messages", asked | {"max_tokens": 2, "tool_choice": {"type": "none"}})
    assert reply.status_code == 200 and reply.json()["usage"]["input_tokens"] == 4, reply.text


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"max_tokens": None}, "max_tokens"),  # missing: Anthropic requires it
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"stream": 1}, "stream"),
        ({"system": 5}, "system"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "w5"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [TOOL_HISTORY[1]["content"][2]]}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}, IMAGE]}]},
            "messages[0].content[1]",
        ),
        ({"system": "w3", "messages": [{"role": "user", "content": "w5 " * 300}]}, "messages"),  # too long
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs the server's tool-call parser
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(start_app, change: dict[str, Any], names: str) -> None:
    url = start_app().url
    body = {key: value for key, value in (PLAIN | change).items() if value is not None}
    assert_error(post(url, "/v1/messages", body), 400, "invalid_request_error", names)


def test_other_errors_in_anthropics_shape(start_app) -> None:
    url = start_app(max_request_bytes=2000).url
    assert_error(post(url, "/v1/messages", PLAIN | {"model": "gpt"}), 404, "not_found_error", "gpt")
    assert_error(
        post(url, "/v1/messages/count_tokens", {"model": "tiny"}), 400, "invalid_request_error", "messages"
    )
    assert_error(post(url, "/v1/messages/count_tokens", PLAIN | {"model": "x"}), 404, "not_found_error")
    raw = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(raw, 400, "invalid_request_error", "JSON")
    assert_error(post(url, "/v1/messages", PLAIN | {"system": "w3 " * 1000}), 413, "request_too_large")
    assert_error(post(url, "/v1/messages/batches", PLAIN), 404, "not_found_error")
    openai_shaped = post(url, "/v1/chat/completions", {"messages": HELLO, "max_tokens": "5"})
    assert openai_shaped.status_code == 400 and openai_shaped.json()["error"]["param"] == "max_tokens"


def test_the_api_key_in_x_api_key_or_bearer(start_app) -> None:
    url = start_app(api_key="sk-test").url
    assert_error(post(url, "/v1/messages", PLAIN), 401, "authentication_error", "x-api-key")
    assert_error(post(url, "/v1/messages", PLAIN, {"x-api-key": "wrong"}), 401, "authentication_error")
    assert post(url, "/v1/messages", PLAIN, {"x-api-key": "sk-test"}).status_code == 200
    assert post(url, "/v1/messages", PLAIN, {"Authorization": "Bearer sk-test"}).status_code == 200
    chat = post(url, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}, {"x-api-key": "sk-test"})
    assert chat.status_code == 200
    refused = post(url, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_reasoning_is_thinking_blocks(start_app) -> None:
    """deepseek_r1 on a model that never writes </think>: the whole reply is thinking."""
    url = start_app(reasoning_parser="deepseek_r1").url
    asked = PLAIN | {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    (block,) = post(url, "/v1/messages", asked).json()["content"]
    assert block["type"] == "thinking" and block["thinking"] and block["signature"] == ""
    events = events_of(post(url, "/v1/messages", asked | {"stream": True}))
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas) == block["thinking"]


def test_an_engine_failure_mid_stream_is_an_error_event(start_app, make_tiny_engine) -> None:
    url = start_app(make_tiny_engine(fail_at_step=3)).url
    events = events_of(post(url, "/v1/messages", PLAIN | {"max_tokens": 20, "stream": True}))
    assert events[0][0] == "message_start" and "content_block_delta" in [name for name, _ in events]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"
    assert "injected device fault" in data["error"]["message"]


# -- the `anthropic` client on SmolLM2 ------------------------------------------------------------------


# the client's create() has no temperature (2.x): sent as Anthropic's API and vLLM take it, in the body
GREEDY = {"temperature": 0.0}


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


@pytest.mark.slow
def test_the_anthropic_client_message_and_stream(api_server) -> None:
    client = _client(api_server)
    asked: dict[str, Any] = {
        "model": api_server.model,
        "max_tokens": 16,
        "extra_body": GREEDY,
        "system": "You are a geography teacher.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    message = client.messages.create(**asked)
    assert message.type == "message" and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    counted = client.messages.count_tokens(
        model=api_server.model, system=asked["system"], messages=asked["messages"]
    )
    assert counted.input_tokens == message.usage.input_tokens
    with client.messages.stream(**asked) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (
        message.stop_reason,
        message.usage.output_tokens,
    )


@pytest.mark.slow
def test_the_anthropic_client_tool_round_trip(api_server) -> None:
    client = _client(api_server)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked: dict[str, Any] = {
        "model": api_server.model,
        "max_tokens": 32,
        "extra_body": GREEDY,
        "tools": [WEATHER],
    }
    call = client.messages.create(
        messages=question, tool_choice={"type": "tool", "name": "get_weather"}, **asked
    )
    assert call.stop_reason == "tool_use", call
    (use,) = [block for block in call.content if block.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and isinstance(use.input["city"], str)
    with client.messages.stream(messages=question, tool_choice={"type": "any"}, **asked) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("get_weather", use.input)
    ]

    replies = {}
    # the tool's result reaches the reply: it repeats the temperature, and another result, another reply
    for result in ("Snowing, -7 C", "Sunny, 24 C"):
        answer = client.messages.create(
            messages=[
                *question,
                {"role": "assistant", "content": call.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}],
                },
            ],
            tool_choice={"type": "none"},
            **asked,
        )
        assert answer.content[0].type == "text" and answer.content[0].text
        assert answer.stop_reason in ("end_turn", "max_tokens")
        replies[result] = answer.content[0].text
    cold, sunny = replies.values()
    assert "-7" in cold and "-7" not in sunny and cold != sunny, replies
