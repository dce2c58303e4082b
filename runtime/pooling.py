"""Embeddings: how a prompt's final hidden states become one vector (pooling, as llama-server's
`--pooling` and vLLM's pooler), and what a request asks of it.

    last   the prompt's last token's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral)
    mean   the mean over every prompt token's hidden state
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from kiln.runtime.sampling_params import SamplingParams

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean")
Embedding = npt.NDArray[np.float32]
# what an embedding request is checked and scheduled as: a prompt that leaves room for one token
EMBEDDING_PARAMS = SamplingParams(max_tokens=1)


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first this many values (a Matryoshka-trained model's shorter vectors),
    before normalizing; None: all of them."""

    pooling: PoolingType = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt token's hidden state is read (so no prompt block may come from the
        prefix cache, whose blocks hold K/V, not hidden states)."""
        return self.pooling == "mean"


@dataclass
class PooledRows:
    """A request's pooling in progress, chunk by chunk (a preempted request starts again at 0)."""

    params: PoolingParams
    total: npt.NDArray[np.float64] | None = None
    count: int = 0
    last: npt.NDArray[np.float32] | None = field(default=None, repr=False)

    def add(self, start: int, rows: npt.NDArray[np.float32]) -> None:
        """`rows`: the hidden states read for the chunk that starts at prompt position `start`."""
        if not len(rows):
            return
        if self.params.pooling == "last":
            self.last = rows[-1].copy()
            return
        if start == 0:
            self.total, self.count = None, 0
        summed = rows.sum(axis=0, dtype=np.float64)
        self.total = summed if self.total is None else self.total + summed
        self.count += len(rows)

    def result(self) -> Embedding:
        if self.params.pooling == "last":
            assert self.last is not None, "the prompt's last row was never read"
            vector = self.last.astype(np.float64)
        else:
            assert self.total is not None and self.count, "no prompt row was read"
            vector = self.total / self.count
        return finish(vector, self.params)


def finish(vector: npt.NDArray[np.float64], params: PoolingParams) -> Embedding:
    """Truncated to `params.dimensions`, then scaled to unit length if asked."""
    if params.dimensions is not None:
        if params.dimensions > vector.shape[0]:
            raise ValueError(
                f"dimensions must be <= the model's hidden size {vector.shape[0]}, got {params.dimensions}"
            )
        vector = vector[: params.dimensions]
    if params.normalize:
        norm = float(np.linalg.norm(vector))
        vector = vector / max(norm, 1e-12)
    return vector.astype(np.float32)
