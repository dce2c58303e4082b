"""The FastAPI app: thin routes over the serving classes, the API-key check, the error handlers.

    app = create_app(AsyncEngine(llm_engine), "my-model", api_key=None, max_waiting=None)

With an API key, every route but /health and /metrics needs `Authorization: Bearer <key>` (or
Anthropic's `x-api-key: <key>`); the check
runs before the body is read, so a request without the key is a 401 whatever its body. A body over
`max_request_bytes` is a 413 (see body_limit.py).
"""

from __future__ import annotations

import hmac
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.live_weights import WeightSource
from kiln.server.body_limit import BodyLimitMiddleware, default_max_request_bytes
from kiln.server.errors import install_error_handlers, unauthorized
from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InitWeightTransferRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsRequest,
)
from kiln.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from kiln.server.protocol_embeddings import EmbeddingRequest
from kiln.server.protocol_responses import ResponsesRequest
from kiln.server.response_store import ResponseStore
from kiln.server.serving_chat import OpenAIServingChat
from kiln.server.serving_completions import OpenAIServingCompletion
from kiln.server.serving_embeddings import OpenAIServingEmbedding
from kiln.server.serving_engine import Admission, MediaLimits
from kiln.server.serving_lora import OpenAIServingLoRA
from kiln.server.serving_messages import AnthropicServingMessages
from kiln.server.serving_responses import OpenAIServingResponses
from kiln.server.serving_tokenize import OpenAIServingTokenization
from kiln.server.serving_weights import ServingWeights
from kiln.server.strict_json import StrictJSONRoute

UNPROTECTED_PATHS = frozenset({"/health", "/metrics"})

router = APIRouter(route_class=StrictJSONRoute)


def _state(request: Request) -> State:
    return request.app.state


@router.get("/health")
async def health(request: Request) -> Response:
    dead = _state(request).engine.dead
    return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE if dead is not None else HTTPStatus.OK)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    models = state.tokenization.models()
    version = state.engine.weight_version
    models.data[0].weight_version, models.data[0].weight_source = version.number, version.source
    models.data += state.lora.cards(state.engine.max_model_len)
    return JSONResponse(models.model_dump())


# only with --allow-runtime-lora-updating (create_app's allow_lora_updates)
lora_router = APIRouter(route_class=StrictJSONRoute)


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    return PlainTextResponse(await _state(request).lora.load(body))


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    return PlainTextResponse(await _state(request).lora.unload(body))


# only with --enable-weight-updates (create_app's weights)
weights_router = APIRouter(route_class=StrictJSONRoute)


@weights_router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest, request: Request) -> JSONResponse:
    return JSONResponse(await _state(request).weights.update_from_disk(body))


@weights_router.post("/init_weight_transfer_engine")
@weights_router.post("/init_weight_transfer")
async def init_weight_transfer(body: InitWeightTransferRequest, request: Request) -> JSONResponse:
    return JSONResponse(await _state(request).weights.init_transfer(body))


@weights_router.post("/update_weights")
async def update_weights(body: UpdateWeightsRequest, request: Request) -> JSONResponse:
    return JSONResponse(await _state(request).weights.update_from_trainer(body))


@weights_router.post("/pause")
async def pause(request: Request, mode: str = "wait") -> JSONResponse:
    return JSONResponse(await _state(request).weights.pause(mode))


@weights_router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    return JSONResponse(await _state(request).weights.resume())


@weights_router.get("/is_paused")
async def is_paused(request: Request) -> JSONResponse:
    return JSONResponse({"is_paused": _state(request).engine.paused})


@weights_router.post("/sleep")
async def sleep(request: Request, level: int = 1) -> JSONResponse:
    return JSONResponse(await _state(request).weights.sleep(level))


@weights_router.post("/wake_up")
async def wake_up(request: Request) -> JSONResponse:
    return JSONResponse(await _state(request).weights.wake_up())


@weights_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> JSONResponse:
    level = _state(request).engine.asleep
    return JSONResponse({"is_sleeping": bool(level), "level": level})


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _state(request).completions.create(body, request)


@router.post("/v1/embeddings")
async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    return await _state(request).embeddings.create(body, request)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _state(request).chat.create(body, request)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await _state(request).responses.create(body, request)


# async, as the store is read and written on the event loop alone
@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_state(request).responses.retrieve(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_state(request).responses.delete(response_id))


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await _state(request).messages.create(body, request)


# Plain functions: FastAPI runs them on a worker thread, so tokenizing a long text and rendering a long
# response leave the event loop free.


@router.post("/tokenize")
def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(_state(request).tokenization.tokenize(body).model_dump())


@router.post("/detokenize")
def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(_state(request).tokenization.detokenize(body).model_dump())


@router.post("/v1/messages/count_tokens")
def count_message_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    return JSONResponse(_state(request).messages.count_tokens(body).model_dump())


class APIKeyMiddleware:
    """401 for a request without `Authorization: Bearer <key>` or `x-api-key: <key>`, before routing or
    reading the body."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in UNPROTECTED_PATHS
            and scope["method"] != "OPTIONS"
        ):
            headers = dict(scope["headers"])
            bearer, key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
            if not (
                hmac.compare_digest(bearer, self.expected) or hmac.compare_digest(key, self.expected_key)
            ):
                await unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None,
    max_waiting: int | None,
    *,
    max_request_bytes: int | None = None,
    auto_tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    media: MediaLimits | None = None,
    allow_lora_updates: bool = False,
    weights: WeightSource | None = None,
) -> FastAPI:
    """The server for one engine. The caller owns the engine (and shuts it down after the server).

    `max_request_bytes` None: `default_max_request_bytes` of the engine's max_model_len; `media`: where a
    request's images may come from and how many a prompt may hold (None: data: URLs, 8 images);
    `allow_lora_updates`: the routes that load and unload LoRA adapters at run time; `weights`: where
    new weights come from (kiln.compiler.refit.Refitter): the routes that update them, pause and sleep.
    """
    if max_waiting is not None and max_waiting < 0:
        raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(engine.max_model_len)
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app = FastAPI(title="Kiln", summary="OpenAI-compatible LLM server")
    admission = Admission(engine.max_num_seqs, max_waiting)
    server_metrics = ServerMetrics(engine, served_model_name)
    state = app.state
    state.engine = engine
    state.metrics = server_metrics
    state.completions = OpenAIServingCompletion(engine, served_model_name, admission, server_metrics)
    state.chat = OpenAIServingChat(engine, served_model_name, admission, server_metrics, media)
    state.chat.auto_tool_parser = auto_tool_parser
    state.chat.reasoning_parser = reasoning_parser
    state.responses = OpenAIServingResponses(state.chat, ResponseStore())
    state.messages = AnthropicServingMessages(state.chat)
    state.tokenization = OpenAIServingTokenization(
        engine, served_model_name, admission, server_metrics, media
    )
    state.lora = OpenAIServingLoRA(engine, served_model_name)
    state.embeddings = OpenAIServingEmbedding(engine, served_model_name, admission, server_metrics)
    app.include_router(router)
    if allow_lora_updates:
        app.include_router(lora_router)
    if weights is not None:
        state.weights = ServingWeights(engine, weights)
        app.include_router(weights_router)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # added last, so it runs first
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
