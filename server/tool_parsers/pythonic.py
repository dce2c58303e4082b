"""Pythonic tool calls (Llama 3.2 / 4 style): the whole reply is a Python list of calls with keyword
arguments, `[get_weather(city="Paris"), now()]`. Read once the text is final."""

from __future__ import annotations

import ast
import json

from kiln.server.tool_parsers import Parsed, ParsedCall


def _calls(text: str) -> tuple[ParsedCall, ...] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return tuple(calls)


def parse(text: str, final: bool) -> Parsed:
    body = text.lstrip()
    if body and not body.startswith("["):
        return Parsed(text)
    if not final:
        return Parsed("")
    calls = _calls(body)
    return Parsed("", calls) if calls is not None else Parsed(text)
