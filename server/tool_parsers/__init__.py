"""Tool-call parsers: model text → (content, tool calls), whole or streamed.

Each parser is one module with one function, `parse(text, final)`: the content and the calls the text
holds. Before the text is final it reports only what cannot change: content up to where a call may
begin (a partial marker is held back), and a call once it is complete. `ToolCallStream` turns those
reports into deltas, so a stream always reassembles to what the whole text parses to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[ParsedCall, ...] = ()


Parser = Callable[[str, bool], Parsed]


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
        if content.startswith(self.sent_content) and (final or content.strip()):
            new_content = content[len(self.sent_content) :]
            self.sent_content = content
        if final and not content.strip():
            new_content = ""
        calls = list(parsed.calls[self.sent_calls :])
        self.sent_calls = len(parsed.calls)
        return new_content, calls


def parser(name: str) -> Parser:
    from kiln.server.tool_parsers import hermes, llama3_json, mistral, pythonic

    return {
        "hermes": hermes.parse,
        "llama3_json": llama3_json.parse,
        "mistral": mistral.parse,
        "pythonic": pythonic.parse,
    }[name]


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
