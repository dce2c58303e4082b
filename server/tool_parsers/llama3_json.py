"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`). A reply that starts otherwise is content. Read once the
text is final; until then a reply that may become a call is held back."""

from __future__ import annotations

import json

from kiln.server.tool_parsers import Parsed, ParsedCall

PYTHON_TAG = "<|python_tag|>"


def _calls(body: str) -> tuple[ParsedCall, ...] | None:
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        if at == len(body):
            return tuple(calls) if calls else None
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("parameters", value.get("arguments", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ParsedCall(value["name"], text))


def parse(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    body = body.removeprefix(PYTHON_TAG).lstrip() if body.startswith(PYTHON_TAG) else body
    maybe_call = body.startswith("{") or PYTHON_TAG.startswith(text.lstrip()) or not body
    if not maybe_call:
        return Parsed(text)
    if not final:
        return Parsed("")
    calls = _calls(body)
    return Parsed("", calls) if calls is not None else Parsed(text)
