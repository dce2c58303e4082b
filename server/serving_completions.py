"""POST /v1/completions: one engine request per prompt, n choices each, streamed or not.

Choice `i * n + j` is sample j of prompt i, as OpenAI numbers them. Logprobs take OpenAI's legacy
shape: tokens, token_logprobs, top_logprobs (token text → logprob, the chosen token included, as vLLM
does) and text_offset (into the choice's text, the echoed prompt included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kiln.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kiln.server.errors import bad_request
from kiln.server.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from kiln.server.serving_engine import (
    CLIENT_LEFT,
    OpenAIServing,
    Prepared,
    event_stream,
    finite,
    merge,
    sse,
    sse_errors,
    started,
    weight_version_header,
    whole_outputs,
)


@dataclass
class _Prompt:
    prepared: Prepared
    text: str  # for echo


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        prompts = await asyncio.to_thread(self._prepare, request)
        hold = self.admit([p.prepared for p in prompts])
        request_id = self.request_id("cmpl")
        streams = [self.generate(p.prepared, f"{request_id}-{i}") for i, p in enumerate(prompts)]
        created = int(time.time())
        if request.stream:
            firsts, streams = await started(streams, hold)
            body = sse_errors(self._stream(request, request_id, created, prompts, streams), hold)
            hold.release_with(body)
            return event_stream(body, firsts)
        finals = await whole_outputs(raw_request, streams, hold)
        if finals is None:
            return Response(status_code=CLIENT_LEFT)
        return JSONResponse(
            self._response(request, request_id, created, prompts, finals).model_dump(),
            headers=weight_version_header(finals),
        )

    def _prepare(self, request: CompletionRequest) -> list[_Prompt]:
        """Tokenized and checked; run off the event loop (tokenizing a long prompt takes a while)."""
        lora = self.check_model(request.model)
        if request.suffix is not None:
            raise bad_request("suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of must equal n: best-of sampling is not supported", "best_of")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        params = self.sampling_params(request, request.to_sampling_params)
        prompts = request.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                token_ids = self.encode(prompt, "prompt")
                text = prompt
            else:
                self.check_token_ids(prompt, "prompt")
                token_ids = list(prompt)
                text = self.tokenizer.decode(token_ids) if request.echo else ""
            prepared = self.check_prompt(
                token_ids, params, "prompt", "max_tokens", request.priority, lora=lora
            )
            out.append(_Prompt(prepared, text))
        return out

    # -- non-streamed -------------------------------------------------------------------------------------

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: Sequence[_Prompt],
        finals: Sequence[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for output in sorted(final.outputs, key=lambda o: o.index):
                prefix = prompt.text if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = CompletionLogProbs()
                    if request.echo:
                        self._add_prompt_logprobs(logprobs, final)
                    self._add_logprobs(logprobs, output.token_ids, output.logprobs or [], len(prefix))
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + output.index,
                        text=prefix + output.text,
                        logprobs=logprobs,
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.response_model(request.model),
            choices=choices,
            usage=_usage(finals),
        )

    # -- streamed -----------------------------------------------------------------------------------------

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: Sequence[_Prompt],
        streams: Sequence[AsyncGenerator[RequestOutput, None]],
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        ended: set[int] = set()
        offsets: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        async for i, output in merge(streams):
            if output.finished:
                finals[i] = output
            for sample in output.outputs:
                index = i * request.n + sample.index
                if index in ended:
                    continue
                choice = self._delta_choice(
                    request, index, prompts[i], output, sample, index not in started, offsets
                )
                if choice is None:
                    continue
                started.add(index)
                if sample.finished:
                    ended.add(index)
                yield sse(
                    CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.response_model(request.model),
                        choices=[choice],
                    )
                )
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = _usage([finals[i] for i in sorted(finals)])
            yield sse(
                CompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.response_model(request.model),
                    choices=[],
                    usage=usage,
                )
            )

    def _delta_choice(
        self,
        request: CompletionRequest,
        index: int,
        prompt: _Prompt,
        output: RequestOutput,
        sample: CompletionOutput,
        first: bool,
        offsets: dict[int, int],
    ) -> CompletionResponseChoice | None:
        text = sample.delta_text
        want_logprobs = request.logprobs is not None
        if not (
            text or sample.finished or (want_logprobs and sample.delta_token_ids) or (first and request.echo)
        ):
            return None
        logprobs = CompletionLogProbs() if want_logprobs else None
        if first and request.echo:
            text = prompt.text + text
            if logprobs is not None:
                self._add_prompt_logprobs(logprobs, output)
            offsets[index] = len(prompt.text)
        if logprobs is not None:
            offset = self._add_logprobs(
                logprobs, sample.delta_token_ids, sample.delta_logprobs or [], offsets.get(index, 0)
            )
            offsets[index] = offset
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    # -- logprobs -----------------------------------------------------------------------------------------

    def _add_logprobs(
        self,
        out: CompletionLogProbs,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs],
        offset: int,
    ) -> int:
        """Append the tokens' entries; the text offset after them."""
        for token_id, top in zip(token_ids, logprobs, strict=False):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(finite(top.get(token_id)))
            out.top_logprobs.append({self.token_text(t): finite(lp) for t, lp in top.items()})  # type: ignore[misc]
            out.text_offset.append(offset)
            offset += len(text)
        return offset

    def _add_prompt_logprobs(self, out: CompletionLogProbs, output: RequestOutput) -> None:
        """echo with logprobs: the prompt's tokens first; its first token has no logprob."""
        offset = 0
        entries = output.prompt_logprobs or []
        for position, token_id in enumerate(output.prompt_token_ids):
            text = self.token_text(token_id)
            top = entries[position] if position < len(entries) else None
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if top is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(finite(top.get(token_id)))
                out.top_logprobs.append({self.token_text(t): finite(lp) for t, lp in top.items()})  # type: ignore[misc]


def _usage(finals: Sequence[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
    completion_tokens = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
