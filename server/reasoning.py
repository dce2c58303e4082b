"""Reasoning parsers: a reply's `<think>…</think>` part becomes the message's `reasoning_content` (and
`reasoning`, vLLM's newer name), the rest its content; whole or streamed alike.

    deepseek_r1   the reply starts inside the thinking (the template opened `<think>`); everything up
                  to `</think>` is reasoning, all of it while `</think>` has not come
    qwen3         reasoning only where the reply opens with `<think>` (thinking can be switched off)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.runtime.sampling_params import ReasoningTokens
from kiln.runtime.structured_output import ReasoningPhase, first_phase
from kiln.server.tool_parsers import held_back

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def reasoning_tokens(parser: str, token_to_id: Callable[[str], int | None]) -> ReasoningTokens | None:
    """The markers' token ids, for a structured output to hold outside the reasoning; None where the
    vocabulary spells them in several tokens (the constraint then holds from the reply's first token)."""
    start, end = token_to_id(START), token_to_id(END)
    if start is None or end is None:
        return None
    return ReasoningTokens(start, end, implicit_start=parser == "deepseek_r1")


def reply_parser(parser: str, tokens: ReasoningTokens | None, prompt: list[int]) -> str:
    """How a reply's reasoning reads after `prompt`, as the engine's constraint sees it: where the prompt
    opened the block (or `parser` implies it) the reply starts inside, as deepseek_r1 reads it; where
    the prompt closed it, or left none, the reply reasons only if it opens a block, as qwen3 reads it."""
    if tokens is None:
        return parser
    return "deepseek_r1" if first_phase(tokens, prompt) is ReasoningPhase.INSIDE else "qwen3"


def count_reasoning_tokens(
    parser: str,
    markers: ReasoningTokens | None,
    token_ids: Sequence[int],
    reasoning: str,
    encode: Callable[[str], list[int]],
) -> int:
    """How many of a reply's tokens are its reasoning (usage's `reasoning_tokens`): `parser` as
    `reply_parser` gave it, `token_ids` the reply's (without the EOS that ended it), `reasoning` the text
    `split` made of it. Where each marker is one token (`markers`), counted in the reply's own tokens as
    vLLM does: from after a `<think>` that opens the block (or from the start, where the reply starts
    inside), up to `</think>` or the end, the markers not counted; where they are spelled in pieces,
    the reasoning text's own tokens."""
    if not reasoning:
        return 0
    if markers is None:
        return len(encode(reasoning))
    ids = list(token_ids)
    end = ids.index(markers.end) if markers.end in ids else len(ids)
    if markers.start in ids[:end]:
        begin = ids.index(markers.start) + 1  # qwen3: after the whitespace that may come first
        if parser == "deepseek_r1" and begin != 1:
            begin = 0  # a `<think>` inside the reasoning is part of it (`split` strips a leading one only)
    elif parser == "qwen3":
        return len(encode(reasoning))  # the reply spelled `<think>` in pieces
    else:
        begin = 0
    return end - begin


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
