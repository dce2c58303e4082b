"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call;
the content is the text before the first block. Small Qwen2.5-Coder models often write the call's
JSON alone, without the tags: a whole reply that is such JSON (one call a line) is read as calls too,
once the text is final (until then a reply starting with `{` is held back)."""

from __future__ import annotations

import json

from kiln.server.tool_parsers import Parsed, ParsedCall, held_back

START, END = "<tool_call>", "</tool_call>"


def _call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], text)


def _bare_calls(text: str) -> tuple[ParsedCall, ...] | None:
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return tuple(calls) if calls else None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(json.dumps(value)) if isinstance(value, dict) and "arguments" in value else None
        if call is None:
            return None
        calls.append(call)


def parse(text: str, final: bool) -> Parsed:
    first = text.find(START)
    if first < 0 and text.lstrip().startswith("{"):
        bare = _bare_calls(text) if final else None
        return Parsed("", bare) if bare else Parsed(text if final else "")
    if first < 0:
        return Parsed(text if final else held_back(text, START))
    calls: list[ParsedCall] = []
    at = first
    while at >= 0:
        body_start = at + len(START)
        end = text.find(END, body_start)
        if end < 0:
            last = _call(text[body_start:].strip()) if final else None
            calls += [last] if last is not None else []
            break
        call = _call(text[body_start:end].strip())
        calls += [call] if call is not None else []
        at = text.find(START, end + len(END))
    return Parsed(text[:first], tuple(calls))
