"""Structured outputs through `kiln serve` on SmolLM2 with the `openai` client: 50 JSON schemas, greedy
and sampled, every output parses and validates; regex, choice and grammar; streaming; the 400s."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMAS: list[dict[str, Any]] = json.loads(
    (Path(__file__).resolve().parent.parent / "fixtures" / "json_schemas.json").read_text()
)
MAX_TOKENS = 400


def _messages(schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(schema)}"}]


async def _schema_outputs(server, sampled: bool) -> list[tuple[dict[str, Any], str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    seats = asyncio.Semaphore(16)

    async def one(index: int, schema: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
        async with seats:
            response = await client.chat.completions.create(
                model=server.model,
                messages=_messages(schema),  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=1.0 if sampled else 0.0,
                seed=index if sampled else None,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"schema{index}", "schema": schema, "strict": True},
                },
            )
            choice = response.choices[0]
            return schema, choice.message.content or "", choice.finish_reason

    try:
        return await asyncio.gather(*(one(i, schema) for i, schema in enumerate(SCHEMAS)))
    finally:
        await client.close()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_fifty_json_schemas_always_validate(api_server, sampled: bool) -> None:
    assert len(SCHEMAS) == 50
    for schema, text, finish_reason in asyncio.run(_schema_outputs(api_server, sampled)):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar(api_server, temperature: float) -> None:
    client = _client(api_server)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for seed in range(3):
        regex = client.completions.create(
            model=api_server.model,
            prompt="A code:",
            max_tokens=20,
            temperature=temperature,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, regex.choices[0].text), regex.choices[0].text
        choice = client.chat.completions.create(
            model=api_server.model,
            messages=[{"role": "user", "content": "Pick a color."}],
            max_tokens=10,
            temperature=temperature,
            seed=seed,
            extra_body={"guided_choice": ["red", "green", "blue"]},
        )
        assert choice.choices[0].message.content in ("red", "green", "blue")
        grammar = client.completions.create(
            model=api_server.model,
            prompt="Answer:",
            max_tokens=10,
            temperature=temperature,
            seed=seed,
            extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") " " [0-9]'}},
        )
        assert re.fullmatch(r"(yes|no) [0-9]", grammar.choices[0].text), grammar.choices[0].text


def test_streamed_equals_non_streamed_json_object_and_n(api_server) -> None:
    client = _client(api_server)
    schema = SCHEMAS[6]
    asked = {
        "model": api_server.model,
        "messages": _messages(schema),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "user", "schema": schema}},
    }
    whole = client.chat.completions.create(**asked).choices[0].message.content or ""
    stream = client.chat.completions.create(**asked, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)
    reply = client.chat.completions.create(  # any JSON object: short when the prompt asks for it
        model=api_server.model,
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}],
        max_tokens=100,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    response = client.chat.completions.create(
        model=api_server.model,
        messages=_messages(schema),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=3,
        logprobs=True,
        extra_body={"guided_json": schema},
    )
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        assert choice.logprobs is not None and choice.logprobs.content


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            "nonsense",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "Unclosed"),
        ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "does not compile"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, None, "at most one structured output constraint"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
            "json_schema.schema",
        ),
        ({"guided_choice": []}, None, "non-empty list of strings"),
    ],
)
def test_bad_constraints_are_400s(api_server, body: dict[str, Any], field: str | None, reason: str) -> None:
    client = _client(api_server)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=api_server.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_body=body,
        )
    assert reason in error.value.message
    if field is not None:
        assert error.value.param == field
    assert client.models.list().data  # the server is still serving
