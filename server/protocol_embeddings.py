"""/v1/embeddings bodies, in OpenAI's shape (and vLLM's `normalize` extra)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.server.protocol import RequestModel, ResponseModel


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extras
    normalize: bool = True  # scale each vector to unit length
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of inputs, each a text or token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and isinstance(given[0], int):
            return [given]  # type: ignore[list-item]
        return list(given)  # type: ignore[arg-type]


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32s
    index: int


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding] = Field(default_factory=list)
    model: str
    usage: EmbeddingUsage
