"""Tool calling through `kiln serve qwen2.5-coder-0.5b-instruct --enable-auto-tool-choice
--tool-call-parser hermes` with the `openai` client: the round trip (call → tool result → answer) for
auto, required and a named tool; streamed calls reassemble to the non-streamed ones; arguments
validate against the tool's schema; the 400s of tools and tool_choice."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris today?"}]
CHOICES: dict[str, Any] = {
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("mode", list(CHOICES))
def test_round_trip(qwen_server, mode: str) -> None:
    client = _client(qwen_server)
    # auto with the weather tool alone: offered two, the 0.5B model writes its call in a ```json block
    tools = [WEATHER] if mode == "auto" else TOOLS
    asked = {"model": qwen_server.model, "tools": tools, "tool_choice": CHOICES[mode], "temperature": 0.0}
    reply = client.chat.completions.create(messages=QUESTION, max_tokens=200, **asked)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == ("stop" if mode == "named" else "tool_calls"), choice.message
    calls = choice.message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("chatcmpl-tool-")
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert json.loads(calls[0].function.arguments)["city"] == "Paris"

    stream = client.chat.completions.create(messages=QUESTION, max_tokens=200, stream=True, **asked)  # type: ignore[arg-type]
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta_call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta_call.id or ""
            entry["name"] += (delta_call.function.name or "") if delta_call.function else ""
            entry["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == choice.finish_reason
    assert [(e["name"], e["arguments"]) for e in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert all(e["id"].startswith("chatcmpl-tool-") for e in streamed.values())

    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ],
        },
        *(
            {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"celsius": 18, "sky": "sunny"})}
            for c in calls
        ),
    ]
    answer = client.chat.completions.create(
        model=qwen_server.model,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=60,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"tools": []}, "tools", "at least one tool"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400s(qwen_server, body: dict[str, Any], param: str, reason: str) -> None:
    client = _client(qwen_server)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=qwen_server.model, messages=QUESTION, max_tokens=5, extra_body=body
        )  # type: ignore[arg-type]
    assert reason in error.value.message and error.value.param == param


def test_auto_needs_the_server_flag(api_server) -> None:
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=api_server.model, messages=QUESTION, tools=TOOLS, max_tokens=5)  # type: ignore[arg-type]
