"""POST /v1/chat/completions: the messages through the model's chat template, one engine request with
n choices, streamed or not.

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, then sends content
deltas, and closes it with its finish_reason. Logprobs take the chat shape: per token its text, logprob
and UTF-8 bytes, with the `top_logprobs` most likely alternatives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kiln.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprobs
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
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from kiln.server.serving_engine import (
    ClientDisconnected,
    OpenAIServing,
    Prepared,
    engine_error,
    final_outputs,
    finite,
    sse,
    sse_errors,
    until_disconnect,
)


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        prepared = await asyncio.to_thread(self._prepare, request)
        hold = self.admit([prepared])
        request_id = self.request_id("chatcmpl")
        stream = self.generate(prepared, request_id)
        created = int(time.time())
        if request.stream:
            body = sse_errors(self._stream(request, request_id, created, stream), hold)
            hold.release_with(body)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            (final,) = await until_disconnect(raw_request, final_outputs([stream]))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as error:
            raise engine_error(error) from None
        finally:
            hold.release()
        return JSONResponse(self._response(request, request_id, created, final).model_dump())

    def _prepare(self, request: ChatCompletionRequest) -> Prepared:
        """Templated, tokenized and checked; run off the event loop (long messages take a while)."""
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        params = self.sampling_params(request, request.to_sampling_params)
        text = self.render_chat(request.messages, request.add_generation_prompt)
        token_ids = self.encode(text, "messages", add_special_tokens=False)
        return self.check_prompt(token_ids, params, "messages", request.max_tokens_param)

    def _response(
        self, request: ChatCompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatMessage(content=output.text),
                logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in sorted(final.outputs, key=lambda o: o.index)
        ]
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=_usage(final)
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        stream: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
            )

        for index in range(request.n):
            yield chunk(
                ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            )
        ended: set[int] = set()
        final = None
        async for output in stream:
            final = output
            for sample in output.outputs:
                if sample.index in ended:
                    continue
                choice = self._delta_choice(request, sample)
                if choice is None:
                    continue
                if sample.finished:
                    ended.add(sample.index)
                yield chunk(choice)
        if request.stream_options is not None and request.stream_options.include_usage and final is not None:
            yield sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[], usage=_usage(final)
                )
            )

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
                    **self._entry(token_id, top.get(token_id)),
                    top_logprobs=[TopLogprob(**self._entry(t, lp)) for t, lp in best],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, object]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def _usage(final: RequestOutput) -> UsageInfo:
    prompt_tokens = len(final.prompt_token_ids)
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
