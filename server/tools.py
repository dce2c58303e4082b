"""Tool calling for /v1/chat/completions: what a request's `tools` and `tool_choice` ask for.

    none       no calls; the tools still go to the chat template
    auto       the model's text, read by the server's --tool-call-parser (needs --enable-auto-tool-choice)
    required   a grammar: a JSON list of {"name", "parameters"}, at least one, each a tool's schema
    named      a grammar: that tool's parameters schema; the text is the call's arguments

Each mode is a parser (server/tool_parsers/), so whole replies and streams are read the same way.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.runtime.sampling_params import StructuredOutput
from kiln.runtime.vision import template_content
from kiln.server.errors import bad_request
from kiln.server.protocol import ChatCompletionRequest, ChatMessageParam, NamedToolChoice, TextContentPart
from kiln.server.tool_parsers import Parsed, ParsedCall, Parser
from kiln.server.tool_parsers.registry import parser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None  # for the chat template
    parser: Parser | None
    constraint: StructuredOutput | None


def plan(request: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """`auto_parser`: the server's tool-call parser when --enable-auto-tool-choice is on."""
    tools, choice = request.tools, request.tool_choice
    if tools is not None and not tools:
        raise bad_request("tools must hold at least one tool (or leave it out)", "tools")
    if tools is None:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan("none", None, None, None)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    schemas = {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        named = StructuredOutput.json_schema(schemas[name])
        return ToolPlan("named", template_tools, _named(name), named)
    if choice == "none":
        return ToolPlan("none", template_tools, None, None)
    if choice == "required":
        return ToolPlan(
            "required", template_tools, _required, StructuredOutput.json_schema(_any_call(schemas))
        )
    if auto_parser is None:
        raise bad_request(
            '"auto" tool choice (the default with tools) needs the server started with '
            "--enable-auto-tool-choice and --tool-call-parser",
            "tool_choice",
        )
    return ToolPlan("auto", template_tools, parser(auto_parser), None)


def _any_call(schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    one_of_each = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in schemas.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_of_each}}


def _required(text: str, final: bool) -> Parsed:
    if not final:
        return Parsed("")
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return Parsed(text)
    calls = tuple(
        ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
        for item in items
        if isinstance(item, dict) and "name" in item
    )
    return Parsed("", calls)


def _named(name: str) -> Parser:
    def read(text: str, final: bool) -> Parsed:
        return Parsed("", (ParsedCall(name, text),)) if final else Parsed("")

    return read


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def template_messages(
    messages: list[ChatMessageParam], image_token: str | None = None, template: str | None = None
) -> list[dict[str, Any]]:
    """The messages as chat templates read them: an assistant's tool calls with their arguments as
    objects (as HF templates index them), a tool result with its call's id; with `image_token` (a
    vision-language model's), a message's image parts as the `template` reads them."""
    chat: list[dict[str, Any]] = []
    for message in messages:
        content: Any = message.text()
        if image_token is not None and message.image_parts():
            assert isinstance(message.content, list)
            parts = [part.text if isinstance(part, TextContentPart) else None for part in message.content]
            content = template_content(parts, image_token, template)
        item: dict[str, Any] = {"role": message.role, "content": content, "name": message.name}
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        chat.append(item)
    return chat


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
