"""The tool-call parsers by name (TOOL_CALL_PARSERS lists the names)."""

from __future__ import annotations

from kiln.server.tool_parsers import Parser, hermes, llama3_json, mistral, pythonic

PARSERS: dict[str, Parser] = {
    "hermes": hermes.parse,
    "llama3_json": llama3_json.parse,
    "mistral": mistral.parse,
    "pythonic": pythonic.parse,
}


def parser(name: str) -> Parser:
    return PARSERS[name]
