"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request becomes a `ChatCompletionRequest` (protocol_anthropic.py) and runs as a chat completion does:
the chat server's templating, tool plan (auto, required for "any", named for "tool") and reasoning
split; only the response's shape is this API's. A reply's content is its thinking (with a
--reasoning-parser), its text, then its tool calls as tool_use blocks; a call whose arguments are no
JSON object (cut short by max_tokens) stays text.

A stream sends `message_start`, then each block as `content_block_start`, its deltas and
`content_block_stop`, then `message_delta` (the stop reason and output tokens) and `message_stop`; an
engine error after it began is an `error` event.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kiln.runtime.async_engine import EngineDeadError
from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.server.errors import APIError
from kiln.server.protocol_anthropic import (
    ChatTranslation,
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    InputJSONDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from kiln.server.reasoning import ReasoningStream
from kiln.server.reasoning import split as split_reasoning
from kiln.server.serving_chat import ChatPrepared, OpenAIServingChat
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
from kiln.server.tools import plan


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # its --tool-call-parser and --reasoning-parser are this API's too

    async def create(self, request: MessagesRequest, raw_request: Request) -> Response:
        translation = request.to_chat()
        prepared = await asyncio.to_thread(self._prepare, translation)
        hold = self.chat.admit([prepared.prepared])
        message_id = f"msg_{uuid.uuid4().hex}"
        model = self.chat.response_model(request.model)
        stream = self.chat.generate(prepared.prepared, message_id)
        if request.stream:
            firsts, (stream,) = await started([stream], hold)
            events = _stream(message_id, model, prepared, stream)
            body = _with_error_event(events, hold)
            hold.release_with(body)
            return event_stream(body, firsts)
        outputs = await whole_outputs(raw_request, [stream], hold)
        if outputs is None:
            return Response(status_code=CLIENT_LEFT)
        (final,) = outputs
        message = _message(message_id, model, prepared, final)
        return JSONResponse(message.model_dump(), headers=weight_version_header([final]))

    def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The templated prompt's tokens, as /v1/messages would send them to the engine (each image as
        its rows' tokens); a prompt longer than the context is counted too."""
        translation = request.to_chat()
        chat, conversation = self.chat, translation.request
        with _in_request_terms(translation):
            chat.check_model(conversation.model)
            tools = plan(conversation, None)
            text, images = chat.render_chat(
                conversation.messages, True, tools.tools, conversation.chat_template_kwargs
            )
            token_ids = chat.encode(text, "messages", add_special_tokens=False)
            if images:
                vision = chat.engine.vision
                assert vision is not None
                placeholders = [vision.placeholder(image) for image in images]
                token_ids = chat.expand_images(token_ids, placeholders, "messages")
        return CountTokensResponse(input_tokens=len(token_ids))

    def _prepare(self, translation: ChatTranslation) -> ChatPrepared:
        with _in_request_terms(translation):
            return self.chat.prepare(translation.request)


@contextmanager
def _in_request_terms(translation: ChatTranslation) -> Iterator[None]:
    """Re-raises the chat path's APIError naming this request's field or block where it named its own
    (`messages[2].content[0]` of the chat messages is `messages[1].content[0]` here)."""
    try:
        yield
    except APIError as error:
        param = translation.param(error.param)
        if param == error.param:
            raise
        message = error.message.replace(error.param or "", param or "", 1)
        raise APIError(error.status, message, error.type, param, error.code) from None


def _message(message_id: str, model: str, prepared: ChatPrepared, final: RequestOutput) -> MessagesResponse:
    (output,) = final.outputs
    parser, tools = prepared.reasoning_parser, prepared.tools
    reasoning, text = split_reasoning(parser, output.text, True) if parser else ("", output.text)
    calls: tuple[ParsedCall, ...] = ()
    if tools.parser is not None:
        parsed = tools.parser(text, True)
        text, calls = (parsed.content if parsed.content.strip() else ""), parsed.calls
    content: list[ContentBlock] = [ThinkingBlock(thinking=reasoning)] if reasoning else []
    called = [_tool_block(call) for call in calls]
    text += "".join(block.text for block in called if isinstance(block, TextBlock))
    uses = [block for block in called if isinstance(block, ToolUseBlock)]
    if text or not (content or uses):
        content.append(TextBlock(text=text))
    content += uses
    stop_reason, stop_sequence = _stop(output, bool(uses))
    return MessagesResponse(
        id=message_id,
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(input_tokens=len(final.prompt_token_ids), output_tokens=len(output.token_ids)),
    )


def _tool_block(call: ParsedCall) -> ToolUseBlock | TextBlock:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        return TextBlock(text=call.arguments)
    return ToolUseBlock(id=f"toolu_{uuid.uuid4().hex}", name=call.name, input=arguments)


def _stop(output: CompletionOutput, called: bool) -> tuple[StopReason, str | None]:
    """The stop reason, and the stop sequence that ended the reply (a stop token id is an end of turn)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


async def _stream(
    message_id: str, model: str, prepared: ChatPrepared, stream: AsyncIterator[RequestOutput]
) -> AsyncIterator[str]:
    parser, tools = prepared.reasoning_parser, prepared.tools
    start = MessagesResponse(
        id=message_id,
        model=model,
        content=[],
        stop_reason=None,
        usage=Usage(input_tokens=len(prepared.prepared.prompt_token_ids), output_tokens=0),
    )
    yield _event(MessageStartEvent(message=start))
    thinker = ReasoningStream(parser) if parser else None
    reader = ToolCallStream(tools.parser) if tools.parser else None
    blocks = _Blocks()
    last: CompletionOutput | None = None
    async for output in stream:
        (last,) = output.outputs
        text = last.delta_text
        if thinker is not None:
            thought, text = thinker.feed(text, last.finished)
            for event in blocks.delta(ThinkingBlock(thinking=thought)):
                yield event
        calls: list[ParsedCall] = []
        if reader is not None:
            text, calls = reader.feed(text, last.finished)
        for event in blocks.delta(TextBlock(text=text)):
            yield event
        for call in calls:
            for event in blocks.delta(_tool_block(call)):
                yield event
    assert last is not None
    for event in blocks.finish():
        yield event
    stop_reason, stop_sequence = _stop(last, blocks.called)
    yield _event(
        MessageDeltaEvent(
            delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=MessageDeltaUsage(output_tokens=len(last.token_ids)),
        )
    )
    yield _event(MessageStopEvent())


class _Blocks:
    """The stream's content blocks: text and thinking grow by deltas while theirs is the open block; a
    tool_use block is sent whole (its input as one input_json_delta)."""

    def __init__(self) -> None:
        self.index = 0  # the open block's, or the next one's
        self.open: type[TextBlock] | type[ThinkingBlock] | None = None
        self.called = False

    def delta(self, piece: ContentBlock) -> list[str]:
        if isinstance(piece, ToolUseBlock):
            self.called = True
            partial = InputJSONDelta(partial_json=json.dumps(piece.input, ensure_ascii=False))
            empty = piece.model_copy(update={"input": {}})
            return [
                *self._stop_open(),
                _event(ContentBlockStartEvent(index=self.index, content_block=empty)),
                _event(ContentBlockDeltaEvent(index=self.index, delta=partial)),
                self._stop(),
            ]
        new = piece.text if isinstance(piece, TextBlock) else piece.thinking
        if not new:
            return []
        events = []
        if self.open is not type(piece):
            events += self._stop_open()
            empty = TextBlock(text="") if isinstance(piece, TextBlock) else ThinkingBlock(thinking="")
            events.append(_event(ContentBlockStartEvent(index=self.index, content_block=empty)))
            self.open = type(piece)
        delta = TextDelta(text=new) if isinstance(piece, TextBlock) else ThinkingDelta(thinking=new)
        events.append(_event(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return events

    def finish(self) -> list[str]:
        """The open block closed; an empty text block where the reply had no content at all."""
        if self.index == 0 and self.open is None:
            return [
                _event(ContentBlockStartEvent(index=0, content_block=TextBlock(text=""))),
                _event(ContentBlockStopEvent(index=0)),
            ]
        return self._stop_open()

    def _stop_open(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._stop()]

    def _stop(self) -> str:
        event = _event(ContentBlockStopEvent(index=self.index))
        self.index += 1
        return event


def _event(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def _with_error_event(events: AsyncIterator[str], hold: Hold) -> AsyncIterator[str]:
    """The events, then an `error` event if the request fails after the stream began; the request's
    seats are released however the stream ends (a disconnect cancels it)."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, ValueError, APIError) as error:
        body = engine_error(error).anthropic_body()
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
    finally:
        hold.release()
