"""/v1/responses: on the tiny app, the response and stream shapes (validated as the `openai` client's
types), store / previous_response_id / GET / DELETE, the store's LRU bound and the 4xx; on the real
SmolLM2 server, the `openai` client's `responses.create` plain, streamed, with a JSON schema, and a tool
call round trip."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kiln.server.response_store import ResponseStore, StoredResponse

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
YES_NO = {"type": "json_schema", "name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)


def _post(app, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app.url}/v1/responses", json={"model": "tiny", **body}, timeout=30)


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The SSE events, each checked: its `event:` line names its type, it parses as the client's type."""
    events = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    return events


def test_a_response_in_openai_shape(start_app) -> None:
    app = start_app()
    body = {"input": "w1 w2", "instructions": "w3", "max_output_tokens": 3, "temperature": 0}
    reply = _post(app, {**body, "metadata": {"k": "v"}, "reasoning": {"effort": "low"}, "unknown": 1})
    assert reply.status_code == 200, reply.text
    response = Response.model_validate(reply.json())
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == "tiny" and response.instructions == "w3" and response.metadata == {"k": "v"}
    assert response.max_output_tokens == 3 and response.temperature == 0 and response.store is True
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text" and response.tool_choice == "auto" and response.tools == []
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == []
    assert response.usage is not None and 0 < response.usage.output_tokens <= 3
    assert response.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens" and message.status == "incomplete"
    else:
        assert response.status == "completed" and message.status == "completed"
    # the client's view: output_text is the message's text
    client_response = _client(app).responses.create(model="tiny", **body)  # type: ignore[arg-type]
    assert client_response.output_text == part.text


def test_the_stream_sends_openai_events_in_order(start_app) -> None:
    app = start_app()
    body = {"input": "w1 w2", "max_output_tokens": 4, "temperature": 0}
    whole = _post(app, body).json()
    events = _events(_post(app, {**body, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    final = "response.completed" if whole["status"] == "completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == whole["output"][0]["content"][0]["text"]
    streamed = events[-1]["response"]
    assert streamed["status"] == whole["status"] and streamed["output"][0]["id"] == item_id
    assert streamed["usage"] == whole["usage"]


def test_reasoning_items_with_a_reasoning_parser(start_app) -> None:
    """deepseek_r1: a reply that never closes its thinking is all reasoning."""
    app = start_app(reasoning_parser="deepseek_r1")
    body = {"input": "w1 w2", "max_output_tokens": 3, "temperature": 0}
    whole = Response.model_validate(_post(app, body).json())
    (item,) = whole.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content and item.summary == []
    # all of it reasoning (the tiny vocabulary spells the markers in pieces: counted by the text's tokens)
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 3
    events = _events(_post(app, {**body, "stream": True}))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas and kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == events[-4]["text"] == item.content[0].text


def test_a_failure_mid_stream_is_response_failed(start_app, make_tiny_engine) -> None:
    app = start_app(make_tiny_engine(fail_at_step=3))
    # greedy: the same tokens each run, and no EOS before the failing step
    body = {"input": "w1 w2", "max_output_tokens": 8, "temperature": 0, "stream": True}
    events = _events(_post(app, body))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"


def test_a_named_tool_call_round_trip(start_app) -> None:
    """The tiny model's word vocabulary cannot spell JSON: its call is cut short, but has the shape."""
    app = start_app()
    client = _client(app)
    choice: Any = {"type": "function", "name": "get_weather"}
    asked: dict[str, Any] = {"model": "tiny", "tools": [WEATHER], "tool_choice": choice, "temperature": 0}
    called = client.responses.create(input="w1 w2", max_output_tokens=4, **asked)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "incomplete"
    assert called.status == "incomplete" and call.id and call.id.startswith("fc_") and call.call_id
    assert called.tools[0].type == "function" and called.tools[0].name == "get_weather"

    events = _events(_post(app, {"input": "w1 w2", "max_output_tokens": 4, "stream": True, **asked}))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and kinds[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[4]["arguments"] == call.arguments and events[5]["item"]["name"] == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "w5 w6"}
    answered = client.responses.create(
        model="tiny",
        input=[result],
        previous_response_id=called.id,
        max_output_tokens=2,  # type: ignore[list-item]
    )
    assert answered.output[0].type == "message" and answered.previous_response_id == called.id
    # the same conversation as explicit items
    explicit = [{"role": "user", "content": "w1 w2"}, call.model_dump(exclude_none=True), result]
    same = client.responses.create(model="tiny", input=explicit, max_output_tokens=2, store=False)  # type: ignore[arg-type]
    assert same.usage is not None and answered.usage is not None
    assert same.usage.input_tokens == answered.usage.input_tokens


def test_store_previous_response_get_and_delete(start_app) -> None:
    app = start_app()
    first = _post(
        app, {"input": "w1 w2", "instructions": "w9", "max_output_tokens": 2, "temperature": 0}
    ).json()
    stored = httpx.get(f"{app.url}/v1/responses/{first['id']}")
    assert stored.status_code == 200 and stored.json() == first
    follow = {"input": "w3", "max_output_tokens": 2, "temperature": 0}
    second = _post(app, {**follow, "previous_response_id": first["id"]}).json()
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    # the stored conversation comes first (without its instructions), then the new input
    said = first["output"][0]["content"][0]["text"]
    items = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": [{"type": "output_text", "text": said}]},
        {"role": "user", "content": "w3"},
    ]
    explicit = _post(app, {**follow, "input": items, "store": False}).json()
    assert explicit["usage"]["input_tokens"] == second["usage"]["input_tokens"]
    assert explicit["output"][0]["content"] == second["output"][0]["content"]
    assert explicit["store"] is False
    assert httpx.get(f"{app.url}/v1/responses/{explicit['id']}").status_code == 404

    deleted = httpx.delete(f"{app.url}/v1/responses/{first['id']}")
    assert deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    for gone in (
        httpx.get(f"{app.url}/v1/responses/{first['id']}"),
        httpx.delete(f"{app.url}/v1/responses/{first['id']}"),
        _post(app, {**follow, "previous_response_id": first["id"]}),
    ):
        assert gone.status_code == 404
        error = gone.json()["error"]
        assert error["type"] == "invalid_request_error" and first["id"] in error["message"]
    assert gone.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        _client(app).responses.retrieve(first["id"])
    assert _client(app).responses.retrieve(second["id"]).id == second["id"]


def test_the_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)

    def stored(name: str) -> StoredResponse:
        return StoredResponse({"id": name, "output": [{"type": "message", "id": f"m{name}"}]}, [{"n": name}])

    for name in ("a", "b"):
        store.put(stored(name))
    assert store.get("a") is not None  # a is now more recent than b
    store.put(stored("c"))
    assert len(store) == 2 and store.get("b") is None
    a = store.get("a")
    assert a is not None and a.conversation() == [{"n": "a"}, {"type": "message", "id": "ma"}]
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    with pytest.raises(ValueError, match="max_responses"):
        ResponseStore(0)


FUNCTION_NO_NAME = [{"type": "function", "parameters": {}}]
BAD_FIELDS = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": ["w1"]}, "input"),
    ({"input": [{"role": "robot", "content": "w1"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": ["w1", {"type": "function_call", "name": "f", "arguments": "{}"}][1:]}, "input[0].call_id"),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ]
        },
        "input[0].content[0]",
    ),
    ({"input": "w1", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "w1", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "w1", "text": {"format": "json"}}, "text.format"),
    ({"input": "w1", "text": {"format": {**YES_NO, "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"input": "w1", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "w1", "tools": FUNCTION_NO_NAME}, "tools[0].name"),
    ({"input": "w1", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"input": "w1", "tool_choice": "required"}, "tool_choice"),
    ({"input": "w1", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "w1", "tools": [WEATHER]}, "tool_choice"),  # auto, and the server has no tool parser
    (
        {"input": "w1", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
        "tool_choice",
    ),
    (
        {"input": "w1", "tools": [WEATHER], "tool_choice": "required", "text": {"format": YES_NO}},
        "tool_choice",
    ),
    ({"input": "w1", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "w1", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "w1", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "w1 " * 300}, "input"),
    ({"input": "w1", "temperature": -1}, "temperature"),
    ({"input": "w1", "top_p": 2}, "top_p"),
    ({"input": "w1", "store": "yes"}, "store"),
    ({"input": "w1", "metadata": {"k": 1}}, "metadata.k"),
]


def test_bad_fields_are_400_naming_them(start_app) -> None:
    app = start_app()
    for body, param in BAD_FIELDS:
        reply = _post(app, body)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)


def test_unknown_model_and_response_are_404(start_app) -> None:
    app = start_app()
    reply = _post(app, {"model": "gpt-4", "input": "w1"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
    reply = _post(app, {"input": "w1", "previous_response_id": "resp_nothing"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(f"{app.url}/v1/responses/resp_nothing").status_code == 404


# -- the real model through the `openai` client ----------------------------------------------------------


@pytest.mark.slow
def test_responses_on_the_real_model(api_server) -> None:
    client = api_server.client()
    asked: dict[str, Any] = {
        "model": api_server.model,
        "instructions": "You answer in one short sentence.",
        "input": "What is the capital of France?",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = client.responses.create(**asked)
    assert whole.status in ("completed", "incomplete") and "Paris" in whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens <= 16

    events = list(client.responses.create(stream=True, **asked))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt: Any = {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}
    shaped_ask = {**asked, "max_output_tokens": 32, "text": {"format": fmt}}
    shaped = client.responses.create(**shaped_ask)
    assert shaped.status == "completed"
    jsonschema.validate(json.loads(shaped.output_text), schema)
    with client.responses.stream(**shaped_ask) as stream:  # the client's helper, its events accumulated
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == shaped.output_text


@pytest.mark.slow
def test_a_tool_call_round_trip_on_the_real_model(api_server) -> None:
    client = api_server.client()
    called = client.responses.create(
        model=api_server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=32,
        temperature=0,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", called.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    replies = {}
    # the tool's result reaches the reply: it repeats the temperature, and another result, another reply
    for output in ('{"temperature_celsius": -7, "sky": "snow"}', '{"sky": "sunny"}'):
        result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": output}
        answered = client.responses.create(
            model=api_server.model,
            previous_response_id=called.id,
            input=[result],  # type: ignore[list-item]
            max_output_tokens=16,
            temperature=0,
        )
        assert answered.output[-1].type == "message" and answered.output_text
        replies[output] = answered.output_text
    cold, sunny = replies.values()
    assert "-7" in cold and "-7" not in sunny and cold != sunny, replies
