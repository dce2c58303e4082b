"""A LoRA adapter as a step's LoRA tables take it (ir/step.py LORA_*): for each adapted (module, layer),
a [rank, in] and b [out, rank] float32 with the adapter's scale (alpha / rank, or rsLoRA's alpha /
sqrt(rank)) folded into b. The frontend reads PEFT folders and llama.cpp LoRA GGUFs into it; the runtime
writes it into a slot of the tables."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float32]


@dataclass(frozen=True)
class AdapterWeights:
    source: str  # where it was read from, for messages
    updates: dict[tuple[str, int], tuple[Matrix, Matrix]]  # (module, layer) -> (a [r, in], scaled b [out, r])

    @property
    def rank(self) -> int:
        """The largest rank of its updates (what a table slot must hold)."""
        return max((a.shape[0] for a, _ in self.updates.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.updates.values())

    def digest(self) -> str:
        """A hash of what the adapter computes (its updates, by module and layer): two loads of the same
        adapter share cached K/V blocks, another adapter under the same name never does."""
        hasher = hashlib.sha256()
        for (module, layer), (a, b) in sorted(self.updates.items()):
            for matrix in (a, b):
                array = np.ascontiguousarray(matrix)
                hasher.update(f"{module}:{layer}:{array.dtype}:{array.shape};".encode())
                hasher.update(array.view(np.uint8).reshape(-1))
        return hasher.hexdigest()


@dataclass(frozen=True)
class AdapterBase:
    """What reading an adapter needs to know of the model it adapts: its HF architecture, and the heads
    llama.cpp permuted the rows of q_proj and k_proj by (a llama GGUF LoRA's b rows are permuted too)."""

    architecture: str
    num_attention_heads: int
    num_key_value_heads: int
