"""Each tool-call parser on scripted model text: the whole text, and the same text streamed split at
every character boundary (and one character at a time), reassembling to the same content and calls."""

from __future__ import annotations

import json

import pytest

from kiln.server.tool_parsers import TOOL_CALL_PARSERS, Parsed, ParsedCall, ToolCallStream
from kiln.server.tool_parsers.registry import parser

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "Europe/Paris </tool_call> [TOOL_CALLS]"}))
CASES = {
    "hermes": [
        ("Plain text with < and <tool no call.", Parsed("Plain text with < and <tool no call.")),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
            '"Europe/Paris </tool_call> [TOOL_CALLS]"}}\n</tool_call>',
            None,  # see below: the marker inside a string ends the block early, as in vLLM
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            "</tool_call>",
            Parsed("", (WEATHER,)),
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
            Parsed("", (WEATHER,)),  # cut off before its end tag: read at the end
        ),
        (  # Qwen2.5-Coder's habit: the JSON without the tags
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
            Parsed("", (WEATHER,)),
        ),
        ('{"just": "json"}', Parsed('{"just": "json"}')),
        ('{"name": "Felix", "age": 3}', Parsed('{"name": "Felix", "age": 3}')),  # a "name" is not a call
    ],
    "mistral": [
        ("No tools needed.", Parsed("No tools needed.")),
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {"zone": "Europe/Paris </tool_call> [TOOL_CALLS]"}}]',
            Parsed("", (WEATHER, TIME)),
        ),
    ],
    "llama3_json": [
        ("The answer is 4.", Parsed("The answer is 4.")),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
            '{"name": "get_time", "parameters": {"zone": "Europe/Paris </tool_call> [TOOL_CALLS]"}}',
            Parsed("", (WEATHER, TIME)),
        ),
        ('{"not": "a call"}', Parsed('{"not": "a call"}')),
    ],
    "pythonic": [
        ("Sure, here it is.", Parsed("Sure, here it is.")),
        (
            '[get_weather(city="Paris", unit="celsius"), get_time(zone="Europe/Paris </tool_call> '
            '[TOOL_CALLS]")]',
            Parsed("", (WEATHER, TIME)),
        ),
        ("[1, 2, 3]", Parsed("[1, 2, 3]")),
    ],
}


def _streamed(name: str, pieces: list[str]) -> tuple[str, tuple[ParsedCall, ...]]:
    stream = ToolCallStream(parser(name))
    content, calls = "", []
    for i, piece in enumerate(pieces):
        new_content, new_calls = stream.feed(piece, final=i == len(pieces) - 1)
        content += new_content
        calls += new_calls
    return content, tuple(calls)


@pytest.mark.parametrize("name", TOOL_CALL_PARSERS)
def test_whole_and_streamed_agree(name: str) -> None:
    for text, expected in CASES[name]:
        whole = parser(name)(text, True)
        if expected is not None:
            assert whole == expected, (name, text)
        want = (whole.content if whole.content.strip() else "", whole.calls)
        assert _streamed(name, list(text)) == want, (name, text)
        for cut in range(len(text) + 1):
            assert _streamed(name, [text[:cut], text[cut:]]) == want, (name, text, cut)


def test_hermes_reads_each_block() -> None:
    text = CASES["hermes"][1][0]
    parsed = parser("hermes")(text, True)
    assert parsed.content == "Let me check.\n"
    assert parsed.calls[0] == WEATHER  # the second block's JSON is cut at the end tag in its string
