"""What the completion and chat handlers share: the model check, admission (the --max-waiting limit),
validation into a 400 before anything runs, streaming from the engine with metrics, disconnects, SSE.

NOTE: admission counts sequences, as the engine does. The server knows how many it has handed to the
engine and not yet seen finish; past `max_num_seqs` of them, the rest wait. A request is refused (503)
when admitting it would leave more than `max_waiting` sequences waiting. Counting on the server side
makes the decision exact at once, where the engine's own waiting queue only learns of a request when
its loop thread next runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kiln.errors import KilnError
from kiln.runtime.async_engine import AsyncEngine, EngineDeadError
from kiln.runtime.image_processing import ImageProcessingError
from kiln.runtime.live_weights import EngineAsleepError
from kiln.runtime.lora import LoRARequest
from kiln.runtime.media import MediaError, MediaPolicy, load_image
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.pooling import PoolingParams
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.structured_output import GrammarError
from kiln.runtime.vision import ImageEmbedding, place_images
from kiln.server.errors import (
    APIError,
    bad_request,
    engine_asleep,
    engine_unavailable,
    from_value_error,
    not_found_model,
    overloaded,
)
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import ChatMessageParam, SamplingExtras
from kiln.server.tools import template_messages

if TYPE_CHECKING:
    from PIL import Image

DEFAULT_MAX_IMAGES = 8  # a prompt's images, unless --limit-mm-per-prompt says otherwise

T = TypeVar("T")

MAX_N = 128  # samples per request; the engine's own limit is memory
MIN_LOGPROB = -9999.0  # what -inf is sent as: JSON has no infinities


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


class Admission:
    """Sequences handed to the engine and not yet finished; see the NOTE above."""

    def __init__(self, max_num_seqs: int, max_waiting: int | None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.num_in_flight = 0

    def admit(self, num_seqs: int) -> Hold:
        waiting_after = self.num_in_flight + num_seqs - self.max_num_seqs
        if self.max_waiting is not None and waiting_after > self.max_waiting:
            raise overloaded(
                f"The server is busy: {self.num_in_flight} sequences are in flight for "
                f"{self.max_num_seqs} batch slots, and this request's {num_seqs} would leave more than "
                f"{self.max_waiting} waiting (--max-waiting); retry later."
            )
        self.num_in_flight += num_seqs
        return Hold(self, num_seqs)


class Hold:
    """A request's seats; released once, when the request ends however it ends."""

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self._admission: Admission | None = admission
        self.num_seqs = num_seqs

    def release(self) -> None:
        if self._admission is not None:
            self._admission.num_in_flight -= self.num_seqs
            self._admission = None

    def release_with(self, owner: object) -> None:
        """Also release when `owner` (a stream that may never be started) is garbage collected."""
        weakref.finalize(owner, self.release)


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be: where from and how large (`policy`), and how many a prompt
    (--limit-mm-per-prompt)."""

    policy: MediaPolicy = field(default_factory=MediaPolicy)
    max_images: int = DEFAULT_MAX_IMAGES


@dataclass
class Prepared:
    """A validated engine request: its prompt's token ids and parameters."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    images: list[ImageEmbedding] = field(default_factory=list)  # their placeholders expanded in the ids
    lora: LoRARequest | None = None  # the adapter the request's `model` names
    pooling: PoolingParams | None = None  # an embedding request's (no tokens are sampled)


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        admission: Admission,
        metrics: ServerMetrics,
        media: MediaLimits | None = None,
    ) -> None:
        self.engine = engine
        self.media = media or MediaLimits()
        self.model_name = model_name
        self.admission = admission
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    # -- checks, each a 4xx/5xx before anything runs --------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for a name served by no one."""
        if model is None or model == self.model_name:
            return None
        adapter = self.engine.find_lora(model)
        if adapter is None:
            raise not_found_model(model)
        return adapter

    def response_model(self, model: str | None) -> str:
        """The `model` of a response: the adapter's name where the request named one."""
        return model if model is not None and model != self.model_name else self.model_name

    def check_engine(self) -> None:
        if self.engine.dead is not None:
            raise engine_unavailable(f"The engine has stopped: {self.engine.dead}")

    def sampling_params(self, request: SamplingExtras, make: Callable[[], SamplingParams]) -> SamplingParams:
        if not 1 <= request.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {request.n}", "n")
        try:
            self.engine.check_priority(request.priority)
        except ValueError as error:
            raise bad_request(str(error), "priority") from None
        try:
            params = make()
        except ValueError as error:
            raise from_value_error(error) from None
        if params.structured_output is not None:  # compiled here, off the event loop, and cached
            try:
                self.engine.compile_grammar(params.structured_output)
            except GrammarError as error:
                fields = request.structured_output_fields()
                raise bad_request(str(error), fields[0][0] if fields else "tools") from None
        vocab = self.tokenizer.vocab_size
        for token in params.logit_bias or {}:
            if not 0 <= token < vocab:
                raise bad_request(
                    f"logit_bias keys must be token ids in [0, {vocab}), got {token}", "logit_bias"
                )
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise bad_request(
                    f"stop_token_ids must be token ids in [0, {vocab}), got {token}", "stop_token_ids"
                )
        return params

    def check_prompt(
        self,
        token_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        max_tokens_param: str,
        priority: int = 0,
        images: Sequence[ImageEmbedding] = (),
        lora: LoRARequest | None = None,
    ) -> Prepared:
        """The engine's own validation, as a 400 naming the field; a prompt that leaves no room for
        output is `context_length_exceeded`. `images`: the prompt's, each placeholder then expanded."""
        if images:
            token_ids = self.expand_images(token_ids, [image.placeholder for image in images], prompt_param)
        if len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens; shorten the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        try:
            ids, _ = self.engine.validate(token_ids, params)
        except ValueError as error:
            message = str(error)
            param = max_tokens_param if "max_tokens" in message else prompt_param
            code = "context_length_exceeded" if "max_model_len" in message else None
            raise bad_request(message, param, code) from None
        return Prepared(ids, params, priority, list(images), lora)

    def expand_images(
        self, token_ids: list[int], placeholders: Sequence[Sequence[int]], param: str
    ) -> list[int]:
        """Each image's placeholder token replaced by its ids (runtime/vision.py `place_images`)."""
        vision = self.engine.vision
        assert vision is not None
        try:
            expanded, _ = place_images(
                token_ids, placeholders, vision.spec.image_token_id, vision.spec.placeholder_id
            )
        except ValueError as error:
            raise bad_request(str(error), param) from None
        return expanded

    def encode(self, prompt: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        except Exception as error:  # the tokenizer refused this text
            raise bad_request(f"{param} cannot be tokenized: {error}", param) from None

    def render_chat(
        self,
        messages: Sequence[ChatMessageParam],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[Image.Image]]:
        """The prompt's text and its images, loaded and decoded (in order); `template_kwargs`: the
        request's chat_template_kwargs, variables the template reads."""
        if not messages:
            raise bad_request("messages must hold at least one message", "messages")
        reserved = {"messages", "tools", "add_generation_prompt"} & set(template_kwargs or {})
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {sorted(reserved)}: they have their own fields",
                "chat_template_kwargs",
            )
        images = self.load_images(messages)
        vision = self.engine.vision
        image_token = vision.spec.placeholder_text if vision is not None and images else None
        chat = template_messages(list(messages), image_token, self.tokenizer.chat_template)
        try:
            text = self.tokenizer.apply_chat_template(
                chat, add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {})
            )
        except KilnError as error:
            raise bad_request(error.one_line(), "messages") from None
        except Exception as error:  # a template that fails on these messages is still a bad request
            raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None
        return text, images

    def load_images(self, messages: Sequence[ChatMessageParam]) -> list[Image.Image]:
        """Every image part's image, fetched and decoded as the server's media policy allows; a 400
        naming the part that cannot be (a text-only model, past --limit-mm-per-prompt, a URL not
        allowed, bytes that are no image or too many pixels)."""
        images = []
        for i, message in enumerate(messages):
            for j, part in message.image_parts():
                where = f"messages[{i}].content[{j}]"
                if "image" not in self.engine.input_modalities:
                    raise bad_request(
                        f"{where} is an image, and model {self.model_name!r} takes text only", where
                    )
                if len(images) == self.media.max_images:
                    raise bad_request(
                        f"{where}: more than {self.media.max_images} images in one prompt (the server's "
                        f"--limit-mm-per-prompt)",
                        where,
                    )
                try:
                    images.append(load_image(part.image_url.url, self.media.policy))
                except MediaError as error:
                    raise bad_request(f"{where}: {error}", where) from None
        return images

    def embed_images(self, images: Sequence[Image.Image], param: str) -> list[ImageEmbedding]:
        """The images through the model's encoder (in this thread: one of the request threads, never the
        event loop)."""
        vision = self.engine.vision
        assert vision is not None or not images
        embedded = []
        for index, image in enumerate(images):
            try:
                embedded.append(vision.embed(image))  # type: ignore[union-attr]
            except ImageProcessingError as error:
                raise bad_request(f"{param}: image {index}: {error}", param) from None
        return embedded

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param} must be token ids in [0, {vocab}), got {bad[0]}", param)

    # -- running -----------------------------------------------------------------------------------------

    def admit(self, prepared: Sequence[Prepared]) -> Hold:
        self.check_engine()
        return self.admission.admit(sum(p.params.n for p in prepared))

    async def generate(self, prepared: Prepared, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The engine's stream with metrics; leaving it early aborts the request."""
        tracker = self.metrics.track()
        stream = self.engine.generate(
            prepared.prompt_token_ids,
            prepared.params,
            request_id,
            prepared.priority,
            prepared.images,
            prepared.lora,
            prepared.pooling,
        )
        try:
            async for output in stream:
                tracker.observe(output)
                yield output
        finally:
            await stream.aclose()
            tracker.close()

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


async def final_outputs(streams: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run the streams together; each one's last output, in order. One failing cancels the others."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        if final is None:
            raise RuntimeError("the engine ended a request without output")
        return final

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(last(stream)) for stream in streams]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index. Leaving early, or one
    stream failing, stops (and so aborts) them all."""
    if len(streams) == 1:  # no task and queue between the engine and the client: one hand-off a token
        (stream,) = streams
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:
            await queue.put((index, error))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, item = entry
            if isinstance(item, BaseException):
                raise item
            yield index, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def whole_outputs(
    raw_request: Request, streams: Sequence[AsyncIterator[RequestOutput]], hold: Hold
) -> list[RequestOutput] | None:
    """Each stream's last output (a request answered whole); None where the client left first (the
    caller answers 499). An engine error becomes the request's; the seats are released either way."""
    try:
        return await until_disconnect(raw_request, final_outputs(streams))
    except ClientDisconnected:
        return None
    except Exception as error:
        raise engine_error(error) from None
    finally:
        hold.release()


def event_stream(body: AsyncIterator[str], firsts: Sequence[RequestOutput]) -> StreamingResponse:
    """An SSE response of `body`, naming the weights of its first outputs."""
    return StreamingResponse(body, media_type="text/event-stream", headers=weight_version_header(firsts))


CLIENT_LEFT = 499  # the status logged for a request whose client went away before its answer


async def until_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def engine_error(error: BaseException) -> APIError:
    """An error raised by the engine once a request is admitted."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return engine_unavailable(str(error))
    if isinstance(error, EngineAsleepError):
        return engine_asleep(error.one_line())
    if isinstance(error, ValueError):
        return from_value_error(error)
    raise error


WEIGHT_VERSION_HEADER = "Kiln-Weight-Version"


def weight_version_header(outputs: Sequence[RequestOutput]) -> dict[str, str]:
    """The header naming the weights a response's tokens came from (several, comma-separated, only where
    one request's prompts ran on both sides of an update)."""
    versions = sorted({output.weight_version for output in outputs})
    return {WEIGHT_VERSION_HEADER: ",".join(str(v) for v in versions)}


async def started(
    streams: Sequence[AsyncGenerator[RequestOutput, None]], hold: Hold
) -> tuple[list[RequestOutput], list[AsyncGenerator[RequestOutput, None]]]:
    """Each stream's first output (its weight version is then fixed: weights change only between
    requests) and the streams from that output on; an error before it is the request's (4xx/503), the
    seats released."""

    async def first_of(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
        try:
            return await anext(stream)
        except StopAsyncIteration:
            raise RuntimeError("the engine ended a request without output") from None

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(first_of(stream)) for stream in streams]
    except BaseExceptionGroup as failed:
        hold.release()
        for stream in streams:
            await stream.aclose()
        raise engine_error(failed.exceptions[0]) from None
    firsts = [task.result() for task in tasks]
    return firsts, [_from(first, stream) for first, stream in zip(firsts, streams, strict=True)]


async def _from(
    first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    try:
        yield first
        async for output in stream:
            yield output
    finally:
        await stream.aclose()


def finite(logprob: float | None) -> float:
    """A logprob fit for JSON (a missing one counts as -inf)."""
    if logprob is None or math.isnan(logprob) or logprob < MIN_LOGPROB:
        return MIN_LOGPROB
    return logprob


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_errors(chunks: AsyncIterator[str], hold: Hold) -> AsyncIterator[str]:
    """An SSE body: the chunks, an error event if the request fails after the stream began, then
    `[DONE]`; the request's seats are released however the stream ends (a disconnect cancels it)."""
    try:
        async for chunk in chunks:
            yield chunk
        yield SSE_DONE
    except (EngineDeadError, ValueError, APIError) as error:
        yield sse(engine_error(error).body())
        yield SSE_DONE
    finally:
        hold.release()
