"""Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call;
the content is the text before the first block. Small Qwen2.5-Coder models often write the call's
JSON alone, without the tags: a whole reply that is such JSON (one call a line) is read as calls too,
once the text is final (until then a reply starting with `{` is held back)."""

from __future__ import annotations

import json

from kiln.server.tool_parsers import Parsed, ParsedCall, call_of, calls_in_sequence, held_back

START, END = "<tool_call>", "</tool_call>"


def _call(body: str) -> ParsedCall | None:
    try:
        return call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def parse(text: str, final: bool) -> Parsed:
    first = text.find(START)
    if first < 0 and text.lstrip().startswith("{"):
        bare = calls_in_sequence(text, strict=True) if final else None  # other JSON stays content
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
