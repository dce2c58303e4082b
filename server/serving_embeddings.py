"""POST /v1/embeddings: each input (a text or token ids) one engine request through the model's `embed`
entry point, pooled as the server's --pooling says (the model's own by default, else the last token),
normalized unless the request says `normalize: false`, the first `dimensions` values kept."""

from __future__ import annotations

import asyncio
import base64

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from kiln.runtime.pooling import EMBEDDING_PARAMS, PoolingParams
from kiln.server.errors import bad_request
from kiln.server.protocol_embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from kiln.server.serving_engine import (
    CLIENT_LEFT,
    OpenAIServing,
    Prepared,
    whole_outputs,
)


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        prepared = await asyncio.to_thread(self._prepare, request)
        hold = self.admit(prepared)
        request_id = self.request_id("embd")
        streams = [self.generate(p, f"{request_id}-{i}") for i, p in enumerate(prepared)]
        finals = await whole_outputs(raw_request, streams, hold)
        if finals is None:
            return Response(status_code=CLIENT_LEFT)
        data = []
        for index, final in enumerate(finals):
            assert final.embedding is not None
            vector = final.embedding
            encoded: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if request.encoding_format == "base64"
                else vector.tolist()
            )
            data.append(Embedding(embedding=encoded, index=index))
        num_tokens = sum(len(p.prompt_token_ids) for p in prepared)
        response = EmbeddingResponse(
            data=data,
            model=self.response_model(request.model),
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    def _prepare(self, request: EmbeddingRequest) -> list[Prepared]:
        """Each input tokenized and checked; run off the event loop (long inputs take a while)."""
        lora = self.check_model(request.model)
        try:
            width = self.engine.check_embeds()
        except ValueError as error:
            raise bad_request(str(error), "model", "model_not_supported") from None
        if request.dimensions is not None and not 1 <= request.dimensions <= width:
            raise bad_request(
                f"dimensions must be in [1, {width}] (the model's hidden size), got {request.dimensions}",
                "dimensions",
            )
        inputs = request.inputs()
        if not inputs:
            raise bad_request("input must hold at least one text or token list", "input")
        pooling = PoolingParams(self.engine.pooling, request.normalize, request.dimensions)
        prepared = []
        for index, given in enumerate(inputs):
            where = "input" if isinstance(request.input, str) or len(inputs) == 1 else f"input[{index}]"
            if isinstance(given, str):
                token_ids = self.encode(given, where, request.add_special_tokens)
            else:
                self.check_token_ids(given, where)
                token_ids = list(given)
            if not token_ids:
                raise bad_request(f"{where} is empty: give a text or at least one token", where)
            checked = self.check_prompt(token_ids, EMBEDDING_PARAMS, where, where, lora=lora)
            checked.pooling = pooling
            prepared.append(checked)
        return prepared
