"""Reasoning parsers: a reply's `<think>…</think>` part becomes the message's `reasoning_content` (and
`reasoning`, vLLM's newer name), the rest its content; whole or streamed alike.

    deepseek_r1   the reply starts inside the thinking (the template opened `<think>`); everything up
                  to `</think>` is reasoning, all of it while `</think>` has not come
    qwen3         reasoning only where the reply opens with `<think>` (thinking can be switched off)
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.server.tool_parsers import held_back

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def split(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of `text`; before it is final, a partial marker at the end is held back."""
    body = text
    if parser == "qwen3":
        stripped = text.lstrip()
        if not stripped.startswith(START):
            if not final and START.startswith(stripped):
                return "", ""
            return "", text
        body = stripped[len(START) :]
    else:
        if not final and START.startswith(text) and text != START:
            return "", ""
        body = text.removeprefix(START)
    end = body.find(END)
    if end < 0:
        return (body if final else held_back(body, END)), ""
    return body[:end], body[end + len(END) :]


@dataclass
class ReasoningStream:
    parser: str
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(new reasoning, new content) after `delta`."""
        self.text += delta
        reasoning, content = split(self.parser, self.text, final)
        new = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new
