"""Anthropic's Messages API bodies (POST /v1/messages, /v1/messages/count_tokens), and a request's
translation into the chat path's `ChatCompletionRequest`.

Requests are strict as protocol.py's are (a wrong JSON type is a 400); unknown fields (cache_control,
service_tier, …) are ignored. Thinking blocks sent back in assistant turns are accepted and left out of
the prompt, as Anthropic leaves earlier turns' thinking out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kiln.server.protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    ContentPart,
    FunctionCallParam,
    FunctionDefinition,
    ImageContentPart,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
    RequestModel,
    ResponseModel,
    TextContentPart,
    ToolCallParam,
    ToolParam,
)

# -- requests -------------------------------------------------------------------------------------------


class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str


class Base64ImageSource(RequestModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLImageSource(RequestModel):
    type: Literal["url"]
    url: str


class ImageBlockParam(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | URLImageSource, Field(discriminator="type")]

    def url(self) -> str:
        source = self.source
        if isinstance(source, URLImageSource):
            return source.url
        return f"data:{source.media_type};base64,{source.data}"


ToolResultPart = Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]


class ToolUseBlockParam(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None  # accepted; the prompt shows the result's content either way


class ThinkingBlockParam(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlockParam = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]
_USER_ONLY = (ToolResultBlockParam,)
_ASSISTANT_ONLY = (ToolUseBlockParam, ThinkingBlockParam, RedactedThinkingBlockParam)


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @field_validator("content")
    @classmethod
    def _blocks_fit_the_role(cls, content: Any, info: Any) -> Any:
        role = info.data.get("role")
        misplaced = _USER_ONLY if role == "assistant" else _ASSISTANT_ONLY
        for index, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, misplaced):
                raise ValueError(f"content[{index}] is a {block.type} block, which a {role} turn cannot hold")
        return content


class ToolDefinition(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, …) are not served


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError('tool_choice of type "tool" needs the tool\'s name')
        return self


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted; the reply's max_tokens bounds the thinking too


class Metadata(RequestModel):
    user_id: str | None = None


class CountTokensRequest(RequestModel):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def to_chat(self) -> ChatTranslation:
        """The same conversation as a chat completion request, for counting: tool choice none, which
        templates the tools as any choice does and needs no tool-call parser."""
        return self._chat(tool_choice="none")

    def _chat(self, **sampling: Any) -> ChatTranslation:
        """The chat request with this one's system prompt, messages, tools and thinking; `sampling`: its
        other fields."""
        messages, locations = _messages(self.system, self.messages)
        tools = None
        if self.tools is not None:
            tools = [
                ToolParam(
                    type="function",
                    function=FunctionDefinition(
                        name=tool.name, description=tool.description, parameters=tool.input_schema
                    ),
                )
                for tool in self.tools
            ]
        template_kwargs = None
        if self.thinking is not None and self.thinking.type != "adaptive":
            # the variable Qwen3-style templates read; other templates ignore it
            template_kwargs = {"enable_thinking": self.thinking.type == "enabled"}
        request = ChatCompletionRequest(
            messages=messages, model=self.model, tools=tools, chat_template_kwargs=template_kwargs, **sampling
        )
        return ChatTranslation(request, locations)


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    def to_chat(self) -> ChatTranslation:
        choice = self.tool_choice
        return self._chat(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            stream=self.stream,
            tool_choice=_chat_tool_choice(choice),
            parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
            user=self.metadata.user_id if self.metadata is not None else None,
        )


# -- translation ----------------------------------------------------------------------------------------

# The chat path's field names where they differ from this API's.
_RENAMED = {"stop": "stop_sequences"}


@dataclass
class ChatTranslation:
    request: ChatCompletionRequest
    # a chat message or content part's location (as the chat path names it in errors) → this request's
    locations: dict[str, str] = field(default_factory=dict)

    def param(self, chat_param: str | None) -> str | None:
        """This request's name for what the chat path calls `chat_param`."""
        if chat_param is None:
            return None
        return self.locations.get(chat_param, _RENAMED.get(chat_param, chat_param))


def _chat_tool_choice(
    choice: ToolChoice | None,
) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        assert choice.name is not None
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return "required" if choice.type == "any" else choice.type


def _messages(
    system: str | list[TextBlockParam] | None, turns: list[MessageParam]
) -> tuple[list[ChatMessageParam], dict[str, str]]:
    """The chat messages, and where each message and content part came from (see ChatTranslation): a
    system message first, then each turn's; a user turn's tool results become tool messages, in order."""
    messages: list[ChatMessageParam] = []
    locations: dict[str, str] = {}

    def add(message: ChatMessageParam, where: str, part_wheres: list[str] | None = None) -> None:
        locations[f"messages[{len(messages)}]"] = where
        for index, part_where in enumerate(part_wheres or []):
            locations[f"messages[{len(messages)}].content[{index}]"] = part_where
        messages.append(message)

    if system is not None:
        content = system if isinstance(system, str) else [_text_part(block) for block in system]
        add(ChatMessageParam(role="system", content=content), "system")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if isinstance(turn.content, str):
            add(ChatMessageParam(role=turn.role, content=turn.content), where)
            continue
        if turn.role == "assistant":
            add(_assistant(turn.content), where)
            continue
        parts: list[ContentPart] = []
        part_wheres: list[str] = []
        for j, block in enumerate(turn.content):
            if isinstance(block, ToolResultBlockParam):
                if parts:
                    add(ChatMessageParam(role="user", content=parts), where, part_wheres)
                    parts, part_wheres = [], []
                result, result_wheres = _tool_result(block, f"{where}.content[{j}]")
                add(result, f"{where}.content[{j}]", result_wheres)
            elif isinstance(block, TextBlockParam | ImageBlockParam):
                parts.append(_part(block))
                part_wheres.append(f"{where}.content[{j}]")
        if parts or not turn.content:
            add(ChatMessageParam(role="user", content=parts), where, part_wheres)
    return messages, locations


def _text_part(block: TextBlockParam) -> TextContentPart:
    return TextContentPart(type="text", text=block.text)


def _part(block: TextBlockParam | ImageBlockParam) -> ContentPart:
    if isinstance(block, TextBlockParam):
        return _text_part(block)
    return ImageContentPart(type="image_url", image_url=ImageURL(url=block.url()))


def _assistant(blocks: list[Any]) -> ChatMessageParam:
    """Text and tool calls; thinking left out."""
    texts = [_text_part(block) for block in blocks if isinstance(block, TextBlockParam)]
    calls = [
        ToolCallParam(
            id=block.id,
            function=FunctionCallParam(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)
            ),
        )
        for block in blocks
        if isinstance(block, ToolUseBlockParam)
    ]
    return ChatMessageParam(role="assistant", content=texts or None, tool_calls=calls or None)


def _tool_result(block: ToolResultBlockParam, where: str) -> tuple[ChatMessageParam, list[str]]:
    content = block.content
    if content is None or isinstance(content, str):
        return ChatMessageParam(role="tool", content=content or "", tool_call_id=block.tool_use_id), []
    parts = [_part(part) for part in content]
    wheres = [f"{where}.content[{k}]" for k in range(len(content))]
    return ChatMessageParam(role="tool", content=parts, tool_call_id=block.tool_use_id), wheres


# -- responses ------------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's signs its thinking; a local model's has nothing to verify


class ToolUseBlock(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(ResponseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(ResponseModel):
    input_tokens: int


# -- stream events (each sent as `event: <type>` and `data: <the event>`) ---------------------------------


class MessageStartEvent(ResponseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class ContentBlockStartEvent(ResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(ResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(ResponseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJSONDelta(ResponseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(ResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStopEvent(ResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(ResponseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaUsage(ResponseModel):
    output_tokens: int


class MessageDeltaEvent(ResponseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(ResponseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
)
