"""Bodies of OpenAI's Responses API (/v1/responses), and its input items read into chat messages.

The request's `input` and `tools` are plain JSON here and read item by item (`conversation_items`,
`function_tools`), so that a bad item is a 400 naming exactly where it is (`input[2].content[0].type`,
`tools[1].type`) rather than the union pydantic failed to match. The response models follow the
`openai` client's `openai.types.responses` shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from kiln.server.errors import bad_request
from kiln.server.protocol import (
    ChatMessageParam,
    FunctionCallParam,
    ImageContentPart,
    ImageURL,
    RequestModel,
    ResponseModel,
    TextContentPart,
    ToolCallParam,
)

# -- request --------------------------------------------------------------------------------------------


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class FunctionTool(RequestModel):
    """A Responses function tool: flat, where chat nests the function under `function`."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # effort and summary are accepted and ignored

    def input_items(self) -> list[dict[str, Any]]:
        """The new input as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input


# input items, each read on its own (see `conversation_items`)


class _TextPart(RequestModel):
    type: Literal["input_text", "output_text"]
    text: str


class _RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


class _ImagePart(RequestModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class _MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


_ITEMS: dict[str, type[RequestModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
}
_PARTS: dict[str, type[RequestModel]] = {
    "input_text": _TextPart,
    "output_text": _TextPart,
    "refusal": _RefusalPart,
    "input_image": _ImagePart,
}
_CHAT_IMAGE_DETAILS = ("auto", "low", "high")

M = TypeVar("M", bound=RequestModel)


def _read(model: type[M], value: dict[str, Any], where: str) -> M:
    try:
        return model.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        field = next((part for part in first["loc"] if isinstance(part, str)), None)
        param = f"{where}.{field}" if field else where
        raise bad_request(f"{param}: {first['msg']}", param) from None


@dataclass
class ChatConversation:
    """The chat messages a conversation's items make, and for each message the request field it came
    from (to name in errors)."""

    messages: list[ChatMessageParam]
    sources: list[str]


def conversation_items(instructions: str | None, items: list[tuple[dict[str, Any], str]]) -> ChatConversation:
    """Chat messages of `instructions` (a system message first) and the items, each with the field it
    came from (`input[3]`, or `previous_response_id` for a stored one). Consecutive function calls join
    the assistant message before them; a function's output is a `tool` message; reasoning is dropped."""
    conversation = ChatConversation([], [])
    if instructions is not None:
        conversation.messages.append(ChatMessageParam(role="system", content=instructions))
        conversation.sources.append("instructions")
    for item, where in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue  # the chat templates take no earlier reasoning back
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(
                f"{where}.type: input items of type {kind!r} are not supported; use message, "
                "function_call or function_call_output",
                f"{where}.type",
            )
        read = _read(model, item, where)
        if isinstance(read, _MessageItem):
            message = _message(read, where)
        elif isinstance(read, _FunctionCallItem):
            call = ToolCallParam(
                id=read.call_id, function=FunctionCallParam(name=read.name, arguments=read.arguments)
            )
            last = conversation.messages[-1] if conversation.messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
                continue
            message = ChatMessageParam(role="assistant", content=None, tool_calls=[call])
        else:
            assert isinstance(read, _FunctionCallOutputItem)
            output = read.output if isinstance(read.output, str) else _text_of(read.output, f"{where}.output")
            message = ChatMessageParam(role="tool", content=output, tool_call_id=read.call_id)
        conversation.messages.append(message)
        conversation.sources.append(where)
    return conversation


def _message(item: _MessageItem, where: str) -> ChatMessageParam:
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return ChatMessageParam(role=role, content=item.content)
    parts: list[TextContentPart | ImageContentPart] = []
    for index, raw in enumerate(item.content):
        part_where = f"{where}.content[{index}]"
        part = _part(raw, part_where)
        if isinstance(part, _ImagePart):
            if part.image_url is None:
                raise bad_request(
                    f"{part_where}: an input_image needs image_url (file_id is not supported)",
                    f"{part_where}.image_url",
                )
            detail = part.detail if part.detail in _CHAT_IMAGE_DETAILS else None
            parts.append(
                ImageContentPart(type="image_url", image_url=ImageURL(url=part.image_url, detail=detail))
            )
        elif isinstance(part, _RefusalPart):
            parts.append(TextContentPart(type="text", text=part.refusal))
        else:
            assert isinstance(part, _TextPart)
            parts.append(TextContentPart(type="text", text=part.text))
    return ChatMessageParam(role=role, content=parts)


def _part(raw: dict[str, Any], where: str) -> RequestModel:
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = raw.get("type")
    model = _PARTS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(
            f"{where}.type: content parts of type {kind!r} are not supported; use input_text, output_text "
            "or input_image",
            f"{where}.type",
        )
    return _read(model, raw, where)


def _text_of(parts: list[dict[str, Any]], where: str) -> str:
    texts = []
    for index, raw in enumerate(parts):
        part = _part(raw, f"{where}[{index}]")
        if not isinstance(part, _TextPart):
            raise bad_request(
                f"{where}[{index}]: a function's output may hold only text", f"{where}[{index}]"
            )
        texts.append(part.text)
    return "\n".join(texts)


def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """The request's tools, each a function tool; any other kind is a 400 naming it."""
    read = []
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"{where}.type: tools of type {kind!r} are not supported; only function tools are",
                f"{where}.type",
            )
        read.append(_read(FunctionTool, tool, where))
    return read


# -- response -------------------------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallOutput(ResponseModel):
    """A function call the model made (an output item)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningOutput(ResponseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallOutput | ReasoningOutput, Field(discriminator="type")]


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
