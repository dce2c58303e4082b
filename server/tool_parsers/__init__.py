"""Tool-call parsers: model text → (content, tool calls), whole or streamed.

Each parser is one module with one function, `parse(text, final)`: the content and the calls the text
holds. Before the text is final it reports only what cannot change: content up to where a call may
begin (a partial marker is held back), and a call once it is complete. `ToolCallStream` turns those
reports into deltas, so a stream always reassembles to what the whole text parses to. This module holds
what the parsers share; registry.py finds one by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ParsedCall, ...] = ()


Parser = Callable[[str, bool], Parsed]


def call_of(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A call from its JSON object, `{"name": ..., "arguments" (or "parameters"): ...}`; arguments as
    JSON text."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = value.get(arguments_key, value.get(other, {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], text)


def calls_in_sequence(
    text: str, separators: str = " \t\r\n", arguments_key: str = "arguments", strict: bool = False
) -> tuple[ParsedCall, ...] | None:
    """The calls of one or more JSON objects one after another (between them only `separators`); None
    unless all of `text` is such calls (`strict`: each object has `arguments_key` itself)."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text):
            return tuple(calls) if calls else None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = call_of(value, arguments_key)
        if call is None or (strict and arguments_key not in value):
            return None
        calls.append(call)


def held_back(text: str, marker: str) -> str:
    """`text` without a suffix that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size]
    return text


@dataclass
class ToolCallStream:
    """The deltas of one streamed choice: new content, then each call as it completes."""

    parser: Parser
    text: str = ""
    sent_content: str = ""
    sent_calls: int = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """(content to send, calls to send) after `delta`; `final` on the choice's last delta."""
        self.text += delta
        parsed = self.parser(self.text, final)
        content = parsed.content
        new_content = ""
        if content.strip() and content.startswith(self.sent_content):  # whitespace alone waits
            new_content = content[len(self.sent_content) :]
            self.sent_content = content
        calls = list(parsed.calls[self.sent_calls :])
        self.sent_calls = len(parsed.calls)
        return new_content, calls


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
