"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`). A reply that starts otherwise is content. Read once the
text is final; until then a reply that may become a call is held back."""

from __future__ import annotations

from kiln.server.tool_parsers import Parsed, calls_in_sequence

PYTHON_TAG = "<|python_tag|>"


def parse(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    body = body.removeprefix(PYTHON_TAG).lstrip() if body.startswith(PYTHON_TAG) else body
    maybe_call = body.startswith("{") or PYTHON_TAG.startswith(text.lstrip()) or not body
    if not maybe_call:
        return Parsed(text)
    if not final:
        return Parsed("")
    calls = calls_in_sequence(body, separators=" \t\r\n;", arguments_key="parameters")
    return Parsed("", calls) if calls is not None else Parsed(text)
