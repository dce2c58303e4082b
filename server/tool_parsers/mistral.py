"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`; the content is the
text before the marker. The calls are read once the text is final."""

from __future__ import annotations

import json

from kiln.server.tool_parsers import Parsed, call_of, held_back

MARKER = "[TOOL_CALLS]"


def parse(text: str, final: bool) -> Parsed:
    at = text.find(MARKER)
    if at < 0:
        return Parsed(text if final else held_back(text, MARKER))
    if not final:
        return Parsed(text[:at])
    try:
        value, _ = json.JSONDecoder().raw_decode(text[at + len(MARKER) :].lstrip())
    except json.JSONDecodeError:
        return Parsed(text[:at])
    items = value if isinstance(value, list) else [value]
    calls = tuple(call for call in map(call_of, items) if call is not None)
    return Parsed(text[:at], calls)
