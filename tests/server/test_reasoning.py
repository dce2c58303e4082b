"""The reasoning parsers on scripted text: whole, and streamed split at every character boundary; and
through `kiln serve --reasoning-parser` (SmolLM2 writes no `</think>`: with deepseek_r1 its whole
reply is reasoning, with qwen3 its whole reply is content)."""

from __future__ import annotations

import openai
import pytest

from kiln.server.reasoning import ReasoningStream, split

CASES = [
    (
        "deepseek_r1",
        "Let me think. 2 + 2 is 4.</think>The answer is 4.",
        ("Let me think. 2 + 2 is 4.", "The answer is 4."),
    ),
    ("deepseek_r1", "<think>hmm</think>\n\nYes.", ("hmm", "\n\nYes.")),
    ("deepseek_r1", "Still thinking, cut off <", ("Still thinking, cut off <", "")),
    ("qwen3", "<think>\nPlan: add.\n</think>\n\n4", ("\nPlan: add.\n", "\n\n4")),
    ("qwen3", "No thinking here: 4 < 5.", ("", "No thinking here: 4 < 5.")),
    ("qwen3", "<think>unfinished", ("unfinished", "")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), CASES)
def test_whole_and_streamed(parser: str, text: str, expected: tuple[str, str]) -> None:
    assert split(parser, text, True) == expected
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser)
        first = stream.feed(text[:cut], False)
        second = stream.feed(text[cut:], True)
        assert (first[0] + second[0], first[1] + second[1]) == expected, cut
    stream = ReasoningStream(parser)
    pieces = [stream.feed(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == expected


@pytest.mark.slow
@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_through_the_server(start_server, parser: str) -> None:
    server = start_server("--max-model-len", "512", "--reasoning-parser", parser)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    asked = {"model": server.model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 12}
    message = client.chat.completions.create(temperature=0.0, **asked).choices[0].message  # type: ignore[arg-type]
    reasoning = getattr(message, "reasoning_content", None)
    if parser == "deepseek_r1":
        assert reasoning and message.content is None
    else:
        assert reasoning is None and message.content
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(temperature=0.0, stream=True, **asked):  # type: ignore[arg-type]
        delta = chunk.choices[0].delta.model_dump()
        for key in streamed:
            streamed[key] += delta.get(key) or ""
    assert streamed == {"reasoning_content": reasoning or "", "content": message.content or ""}
