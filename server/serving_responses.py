"""POST /v1/responses, and GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request becomes a ChatCompletionRequest (its items chat messages, `text.format` the response_format,
its flat function tools chat's) that OpenAIServingChat prepares (template, tool plan, grammar, reasoning
parser) and runs; the reply becomes output items: a `reasoning` item (with a --reasoning-parser), a
`message`, `function_call`s; usage counts the reasoning item's tokens (`reasoning_tokens`). A 400 of the
chat path names the Responses field (`input[2]`, `text.format`, `max_output_tokens`).

A stream is OpenAI's typed events, each `event: <type>` with a `sequence_number`: response.created,
response.in_progress, then each output item in turn (output_item.added, its content part, its deltas,
done events), then response.completed, response.incomplete (the output limit) or response.failed.
With `store` (the default) the response and its conversation are kept (server/response_store.py) for
`previous_response_id` and GET/DELETE.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kiln.runtime.async_engine import EngineDeadError
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import ReasoningTokens
from kiln.server.errors import INVALID_REQUEST, APIError, bad_request
from kiln.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolParam,
)
from kiln.server.protocol_responses import (
    ChatConversation,
    DeletedResponse,
    FunctionCallOutput,
    FunctionTool,
    FunctionToolChoice,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    conversation_items,
    function_tools,
)
from kiln.server.reasoning import ReasoningStream, count_reasoning_tokens
from kiln.server.response_store import ResponseStore, StoredResponse
from kiln.server.serving_chat import OpenAIServingChat
from kiln.server.serving_engine import (
    CLIENT_LEFT,
    Hold,
    engine_error,
    event_stream,
    started,
    weight_version_header,
    whole_outputs,
)
from kiln.server.tool_parsers import ParsedCall, ToolCallStream
from kiln.server.tools import ToolPlan, call_id

# the chat request's fields, as the Responses request names them
_CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_MESSAGE = re.compile(r"messages\[(\d+)\]")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        history = self._history(request.previous_response_id)
        new_items = request.input_items()
        if not new_items and not history:
            raise bad_request("input is required (unless previous_response_id continues a response)", "input")
        sources = (
            ["input"] if isinstance(request.input, str) else [f"input[{i}]" for i in range(len(new_items))]
        )
        conversation = conversation_items(
            request.instructions,
            [(item, "previous_response_id") for item in history] + list(zip(new_items, sources, strict=True)),
        )
        tools = function_tools(request.tools)
        chat_request = _chat_request(request, conversation, tools)
        try:
            chat = await asyncio.to_thread(self.chat.prepare, chat_request)
        except APIError as error:
            raise _renamed(error, conversation.sources) from None
        hold = self.chat.admit([chat.prepared])
        response_id = f"resp_{uuid.uuid4().hex}"
        stream = self.chat.generate(chat.prepared, response_id)
        turn = _Turn(
            self._skeleton(request, response_id, tools),
            [*history, *new_items],
            chat.reasoning_parser,
            chat.prepared.params.reasoning,
        )
        if request.stream:
            firsts, (stream,) = await started([stream], hold)
            body = self._stream(turn, chat.tools, chat.reasoning_parser, stream, hold)
            hold.release_with(body)
            return event_stream(body, firsts)
        outputs = await whole_outputs(raw_request, [stream], hold)
        if outputs is None:
            return Response(status_code=CLIENT_LEFT)
        (final,) = outputs
        reply = self.chat.response(
            chat_request, chat.tools, chat.reasoning_parser, response_id, turn.skeleton.created_at, final
        )
        output = _output_items(reply.choices[0].message, _incomplete(final))
        response = self._finish(turn, output, final)
        return JSONResponse(response.model_dump(mode="json"), headers=weight_version_header([final]))

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id).model_dump()

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise _not_found(previous_response_id, "previous_response_id")
        return stored.conversation()

    def _skeleton(
        self, request: ResponsesRequest, response_id: str, tools: list[FunctionTool]
    ) -> ResponseObject:
        """The response before its output: what the request asked for, echoed."""
        fmt = request.text.format if request.text is not None else None
        choice = request.tool_choice
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            model=self.chat.response_model(request.model),
            output=[],
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning,
            store=request.store is not False,
            temperature=_or(request.temperature, 1.0),
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            tool_choice=choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or "auto",
            tools=[tool.model_dump() for tool in tools],
            top_p=_or(request.top_p, 1.0),
            user=request.user,
        )

    def _finish(self, turn: _Turn, output: list[OutputItem], final: RequestOutput) -> ResponseObject:
        """The whole response, stored where the request asks."""
        incomplete = _incomplete(final)
        response = turn.skeleton.model_copy(
            update={
                "status": "incomplete" if incomplete else "completed",
                "completed_at": None if incomplete else int(time.time()),
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
                "output": output,
                "usage": _usage(final, self._reasoning_tokens(turn, output, final)),
            }
        )
        if response.store:
            self.store.put(StoredResponse(response.model_dump(mode="json"), turn.input_items))
        return response

    def _reasoning_tokens(self, turn: _Turn, output: list[OutputItem], final: RequestOutput) -> int:
        """The reply's tokens that are its reasoning (output's reasoning items), by its reasoning parser."""
        if turn.reasoning_parser is None:
            return 0
        reasoning = "".join(
            part.text for item in output if isinstance(item, ReasoningOutput) for part in item.content
        )
        sample = final.outputs[0]
        tokens = sample.token_ids
        if sample.finish_reason == "stop" and not isinstance(sample.stop_reason, str):
            tokens = tokens[:-1]  # the EOS or stop token that ended it, no text

        def encode(text: str) -> list[int]:
            return self.chat.tokenizer.encode(text, add_special_tokens=False)

        return count_reasoning_tokens(turn.reasoning_parser, turn.markers, tokens, reasoning, encode)

    async def _stream(
        self,
        turn: _Turn,
        tools: ToolPlan,
        parser: str | None,
        stream: AsyncIterator[RequestOutput],
        hold: Hold,
    ) -> AsyncIterator[str]:
        events = _Events()
        output = _StreamedOutput(events)
        thinker = ReasoningStream(parser) if parser else None
        reader = ToolCallStream(tools.parser) if tools.parser else None
        try:
            yield events("response.created", response=turn.skeleton)
            yield events("response.in_progress", response=turn.skeleton)
            final = None
            async for step in stream:
                final = step
                sample = step.outputs[0]
                thought, text = ("", sample.delta_text)
                if thinker is not None:
                    thought, text = thinker.feed(sample.delta_text, sample.finished)
                calls: list[ParsedCall] = []
                if reader is not None:
                    text, calls = reader.feed(text, sample.finished)
                cut_short = sample.finished and sample.finish_reason == "length"
                for chunk in output.text("reasoning", thought) + output.text("message", text):
                    yield chunk
                for call in calls:
                    for chunk in output.call(call, "incomplete" if cut_short else "completed"):
                        yield chunk
            assert final is not None
            for chunk in output.end("incomplete" if _incomplete(final) else "completed"):
                yield chunk
            response = self._finish(turn, output.items, final)
            yield events(f"response.{response.status}", response=response)
        except (EngineDeadError, ValueError, APIError) as error:
            failure = ResponseError(code="server_error", message=engine_error(error).message)
            failed = turn.skeleton.model_copy(
                update={"status": "failed", "error": failure, "output": output.items}
            )
            yield events("response.failed", response=failed)
        finally:
            hold.release()


@dataclass(frozen=True)
class _Turn:
    skeleton: ResponseObject
    input_items: list[dict[str, Any]]  # the conversation before this response: earlier turns, its input
    reasoning_parser: str | None  # how the reply's reasoning reads (reasoning.reply_parser)
    markers: ReasoningTokens | None  # `<think>` and `</think>` where each is one token


def _chat_request(
    request: ResponsesRequest, conversation: ChatConversation, tools: list[FunctionTool]
) -> ChatCompletionRequest:
    fmt = request.text.format if request.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("text.format: a json_schema format needs its schema", "text.format.schema")
        schema = {
            "name": fmt.name,
            "description": fmt.description,
            "schema": fmt.json_schema,
            "strict": fmt.strict,
        }
        response_format = ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat.model_validate(schema)
        )
    elif fmt is not None and fmt.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise bad_request(
            f"max_output_tokens must be >= 1, got {request.max_output_tokens}", "max_output_tokens"
        )
    chat_tools = [
        ToolParam(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            ),
        )
        for tool in tools
    ]
    return ChatCompletionRequest(
        messages=conversation.messages,
        model=request.model,
        tools=chat_tools or None,
        tool_choice=choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        max_completion_tokens=request.max_output_tokens,
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        stream=request.stream,
        user=request.user,
        response_format=response_format,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _renamed(error: APIError, sources: list[str]) -> APIError:
    """A 400 of the chat path, naming the Responses request's field (a message by the item it came from)."""

    def source(match: re.Match[str]) -> str:
        index = int(match[1])
        return sources[index] if index < len(sources) else "input"

    param = error.param
    if param is not None:
        param = (
            _MESSAGE.sub(source, param, count=1) if _MESSAGE.match(param) else _CHAT_PARAMS.get(param, param)
        )
    message = _MESSAGE.sub(source, error.message)
    for chat_name in ("max_completion_tokens", "response_format"):
        message = message.replace(chat_name, _CHAT_PARAMS[chat_name])
    return APIError(error.status, message, error.type, param, error.code)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        HTTPStatus.NOT_FOUND, f"Response with id {response_id!r} not found.", INVALID_REQUEST, param
    )


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _incomplete(final: RequestOutput) -> bool:
    return final.outputs[0].finish_reason == "length"


def _usage(final: RequestOutput, reasoning_tokens: int) -> ResponseUsage:
    input_tokens, output_tokens = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=input_tokens + output_tokens,
    )


def _output_items(message: ChatMessage, incomplete: bool) -> list[OutputItem]:
    """A chat reply's message as output items: its reasoning, its text, its calls (never none: an empty
    reply is an empty message); the last item is incomplete where the reply was cut short."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(
            ReasoningOutput(
                id=_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)], status="completed"
            )
        )
    if message.content is not None or not (items or message.tool_calls):
        items.append(
            OutputMessage(
                id=_item_id("msg"), status="completed", content=[OutputText(text=message.content or "")]
            )
        )
    for call in message.tool_calls:
        function = call.function
        items.append(
            FunctionCallOutput(
                id=_item_id("fc"),
                call_id=call.id,
                name=function.name,
                arguments=function.arguments,
                status="completed",
            )
        )
    if incomplete:
        items[-1].status = "incomplete"
    return items


class _Events:
    """Server-sent events as OpenAI sends them: `event: <type>`, then the data with its sequence number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type: str, **fields: Any) -> str:
        data: dict[str, Any] = {"type": type, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            data[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class _OpenText:
    kind: Literal["reasoning", "message"]
    item_id: str
    output_index: int
    text: str = ""


class _StreamedOutput:
    """The output items of a stream, as events: a text item (reasoning or message) stays open while its
    deltas come and closes when another item begins or the stream ends."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.items: list[OutputItem] = []
        self.open: _OpenText | None = None

    def text(self, kind: Literal["reasoning", "message"], delta: str) -> list[str]:
        if not delta:
            return []
        chunks = self.close("completed") if self.open is not None and self.open.kind != kind else []
        if self.open is None:
            chunks += self._open(kind)
        assert self.open is not None
        self.open.text += delta
        where = self._where(self.open)
        if kind == "message":
            chunks.append(self.events("response.output_text.delta", **where, delta=delta, logprobs=[]))
        else:
            chunks.append(self.events("response.reasoning_text.delta", **where, delta=delta))
        return chunks

    def call(self, call: ParsedCall, status: ItemStatus) -> list[str]:
        chunks = self.close("completed")
        index = len(self.items)
        item = FunctionCallOutput(
            id=_item_id("fc"), call_id=call_id(), name=call.name, arguments="", status="in_progress"
        )
        done = item.model_copy(update={"arguments": call.arguments, "status": status})
        self.items.append(done)
        where = {"item_id": item.id, "output_index": index}
        return [
            *chunks,
            self.events("response.output_item.added", output_index=index, item=item),
            self.events("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.events("response.function_call_arguments.done", **where, arguments=call.arguments),
            self.events("response.output_item.done", output_index=index, item=done),
        ]

    def end(self, status: ItemStatus) -> list[str]:
        """Close the open item; where there was no output at all, an empty message."""
        if self.open is None and not self.items:
            return self._open("message") + self.close(status)
        return self.close(status)

    def close(self, status: ItemStatus) -> list[str]:
        opened = self.open
        if opened is None:
            return []
        self.open = None
        where = self._where(opened)
        item: OutputItem
        if opened.kind == "message":
            part: BaseModel = OutputText(text=opened.text)
            item = OutputMessage(id=opened.item_id, status=status, content=[OutputText(text=opened.text)])
            text_done = self.events("response.output_text.done", **where, text=opened.text, logprobs=[])
        else:
            part = ReasoningText(text=opened.text)
            item = ReasoningOutput(
                id=opened.item_id, status=status, content=[ReasoningText(text=opened.text)]
            )
            text_done = self.events("response.reasoning_text.done", **where, text=opened.text)
        self.items.append(item)
        return [
            text_done,
            self.events("response.content_part.done", **where, part=part),
            self.events("response.output_item.done", output_index=opened.output_index, item=item),
        ]

    def _open(self, kind: Literal["reasoning", "message"]) -> list[str]:
        self.open = _OpenText(kind, _item_id("msg" if kind == "message" else "rs"), len(self.items))
        item: OutputItem
        if kind == "message":
            item = OutputMessage(id=self.open.item_id, status="in_progress", content=[])
            part: BaseModel = OutputText(text="")
        else:
            item = ReasoningOutput(id=self.open.item_id, status="in_progress", content=[])
            part = ReasoningText(text="")
        return [
            self.events("response.output_item.added", output_index=self.open.output_index, item=item),
            self.events("response.content_part.added", **self._where(self.open), part=part),
        ]

    @staticmethod
    def _where(opened: _OpenText) -> dict[str, Any]:
        return {"item_id": opened.item_id, "output_index": opened.output_index, "content_index": 0}
