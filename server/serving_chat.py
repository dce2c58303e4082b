"""POST /v1/chat/completions: the messages (and tools) through the model's chat template, one engine
request with n choices, streamed or not; tool calls read from the text as the request's tool choice
says (server/tools.py).

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, then sends content
deltas and each tool call as it completes (its id, type and name, then its arguments), and closes it
with its finish_reason. Logprobs take the chat shape: per token its text, logprob
and UTF-8 bytes, with the `top_logprobs` most likely alternatives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kiln.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kiln.runtime.sampling_params import SamplingParams
from kiln.server.errors import bad_request
from kiln.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from kiln.server.reasoning import ReasoningStream, reasoning_tokens, reply_parser
from kiln.server.reasoning import split as split_reasoning
from kiln.server.serving_engine import (
    CLIENT_LEFT,
    OpenAIServing,
    Prepared,
    event_stream,
    finite,
    sse,
    sse_errors,
    started,
    weight_version_header,
    whole_outputs,
)
from kiln.server.tool_parsers import ParsedCall, ToolCallStream
from kiln.server.tools import ToolPlan, call_id, plan


@dataclasses.dataclass
class ChatPrepared:
    prepared: Prepared
    tools: ToolPlan
    reasoning_parser: str | None  # how this reply's reasoning reads (reasoning.reply_parser)


class OpenAIServingChat(OpenAIServing):
    auto_tool_parser: str | None = None  # the --tool-call-parser, with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # the --reasoning-parser

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        chat = await asyncio.to_thread(self.prepare, request)
        prepared, tools, parser = chat.prepared, chat.tools, chat.reasoning_parser
        hold = self.admit([prepared])
        request_id = self.request_id("chatcmpl")
        stream = self.generate(prepared, request_id)
        created = int(time.time())
        if request.stream:
            firsts, (stream,) = await started([stream], hold)
            body = sse_errors(self._stream(request, tools, parser, request_id, created, stream), hold)
            hold.release_with(body)
            return event_stream(body, firsts)
        outputs = await whole_outputs(raw_request, [stream], hold)
        if outputs is None:
            return Response(status_code=CLIENT_LEFT)
        (final,) = outputs
        return JSONResponse(
            self.response(request, tools, parser, request_id, created, final).model_dump(),
            headers=weight_version_header([final]),
        )

    def prepare(self, request: ChatCompletionRequest) -> ChatPrepared:
        """Templated, tokenized and checked; run off the event loop (long messages take a while)."""
        lora = self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        tools = plan(request, self.auto_tool_parser)
        if tools.constraint is not None and request.structured_output_fields():
            raise bad_request(
                f"tool_choice {tools.mode} cannot be combined with a structured output", "tool_choice"
            )

        def make() -> SamplingParams:
            params = request.to_sampling_params()
            if tools.constraint is not None:
                params = dataclasses.replace(params, structured_output=tools.constraint)
            if tools.mode == "auto":  # tool-call markers are often special tokens (Qwen's <tool_call>)
                params = dataclasses.replace(params, skip_special_tokens=False)
            if self.reasoning_parser is not None:  # <think> may be special; a grammar holds outside it
                reasoning = reasoning_tokens(self.reasoning_parser, self.tokenizer.token_to_id)
                params = dataclasses.replace(params, skip_special_tokens=False, reasoning=reasoning)
            return params

        params = self.sampling_params(request, make)
        text, images = self.render_chat(
            request.messages, request.add_generation_prompt, tools.tools, request.chat_template_kwargs
        )
        token_ids = self.encode(text, "messages", add_special_tokens=False)
        embedded = self.embed_images(images, "messages")
        prepared = self.check_prompt(
            token_ids, params, "messages", request.max_tokens_param, request.priority, embedded, lora
        )
        parser = self.reasoning_parser
        if parser is not None:
            parser = reply_parser(parser, prepared.params.reasoning, token_ids)
        return ChatPrepared(prepared, tools, parser)

    def response(
        self,
        request: ChatCompletionRequest,
        tools: ToolPlan,
        parser: str | None,
        request_id: str,
        created: int,
        final: RequestOutput,
    ) -> ChatCompletionResponse:
        choices = []
        for output in sorted(final.outputs, key=lambda o: o.index):
            reasoning, text = split_reasoning(parser, output.text, True) if parser else ("", output.text)
            content: str | None = text if text or not parser else None
            calls: list[ToolCall] = []
            if tools.parser is not None:
                parsed = tools.parser(text, True)
                content = parsed.content if parsed.content.strip() else None
                calls = [ToolCall(id=call_id(), function=FunctionCall(**vars(c))) for c in parsed.calls]
            thought = reasoning or None
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=ChatMessage(
                        content=content, reasoning_content=thought, reasoning=thought, tool_calls=calls
                    ),
                    logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                    finish_reason=_finish_reason(tools, output.finish_reason, bool(calls)),
                    stop_reason=output.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.response_model(request.model),
            choices=choices,
            usage=_usage(final),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        tools: ToolPlan,
        parser: str | None,
        request_id: str,
        created: int,
        stream: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.response_model(request.model), choices=[choice]
                )
            )

        for index in range(request.n):
            yield chunk(
                ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            )
        ended: set[int] = set()
        readers = {i: ToolCallStream(tools.parser) for i in range(request.n)} if tools.parser else {}
        thinkers = {i: ReasoningStream(parser) for i in range(request.n)} if parser else {}
        calls_sent: dict[int, int] = {}
        final = None
        async for output in stream:
            final = output
            for sample in output.outputs:
                if sample.index in ended:
                    continue
                thinker = thinkers.get(sample.index)
                if thinker is not None:
                    thought, text = thinker.feed(sample.delta_text, sample.finished)
                    if thought:
                        delta = DeltaMessage(reasoning_content=thought, reasoning=thought)
                        yield chunk(ChatCompletionStreamChoice(index=sample.index, delta=delta))
                    sample = dataclasses.replace(sample, delta_text=text)
                reader = readers.get(sample.index)
                if reader is not None:
                    content, calls = reader.feed(sample.delta_text, sample.finished)
                    first_call = calls_sent.get(sample.index, 0)
                    calls_sent[sample.index] = first_call + len(calls)
                    for choice in self._tool_call_choices(sample.index, first_call, calls):
                        yield chunk(choice)
                    sample = dataclasses.replace(sample, delta_text=content)
                    if sample.finished:
                        reason = _finish_reason(tools, sample.finish_reason, calls_sent[sample.index] > 0)
                        sample = dataclasses.replace(sample, finish_reason=reason)
                choice = self._delta_choice(request, sample)
                if choice is None:
                    continue
                if sample.finished:
                    ended.add(sample.index)
                yield chunk(choice)
        if request.stream_options is not None and request.stream_options.include_usage and final is not None:
            yield sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.response_model(request.model),
                    choices=[],
                    usage=_usage(final),
                )
            )

    @staticmethod
    def _tool_call_choices(
        index: int, first: int, calls: list[ParsedCall]
    ) -> list[ChatCompletionStreamChoice]:
        """Each call as two deltas: its id, type and name (arguments empty), then its arguments."""
        choices = []
        for number, call in enumerate(calls, start=first):
            header = DeltaToolCall(
                index=number,
                id=call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=""),
            )
            arguments = DeltaToolCall(index=number, function=DeltaFunctionCall(arguments=call.arguments))
            for delta in (header, arguments):
                choices.append(
                    ChatCompletionStreamChoice(index=index, delta=DeltaMessage(tool_calls=[delta]))
                )
        return choices

    def _delta_choice(
        self, request: ChatCompletionRequest, sample: CompletionOutput
    ) -> ChatCompletionStreamChoice | None:
        logprobs = self._logprobs(request, sample.delta_token_ids, sample.delta_logprobs)
        if not (sample.delta_text or sample.finished or (logprobs is not None and logprobs.content)):
            return None
        return ChatCompletionStreamChoice(
            index=sample.index,
            delta=DeltaMessage(content=sample.delta_text) if sample.delta_text else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _logprobs(
        self,
        request: ChatCompletionRequest,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs] | None,
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        num_top = request.top_logprobs or 0
        content = []
        for token_id, top in zip(token_ids, logprobs or [], strict=False):
            best = sorted(top.items(), key=lambda item: item[1], reverse=True)[:num_top]
            content.append(
                ChatCompletionTokenLogprob(
                    **self._entry(token_id, top.get(token_id), request.return_tokens_as_token_ids),
                    top_logprobs=[
                        TopLogprob(**self._entry(t, lp, request.return_tokens_as_token_ids)) for t, lp in best
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: float | None, as_id: bool = False) -> dict[str, object]:
        text = self.token_text(token_id)
        token = f"token_id:{token_id}" if as_id else text
        return {"token": token, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finish_reason(tools: ToolPlan, reason: str | None, called: bool) -> str | None:
    """ "tool_calls" where the model chose to call (auto, required) and was not cut short; a named
    tool's call ends with "stop", as OpenAI's do."""
    if called and reason == "stop" and tools.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def _usage(final: RequestOutput) -> UsageInfo:
    prompt_tokens = len(final.prompt_token_ids)
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
