"""The step contract: what a compiled model's one function takes (see DESIGN.md), and how per-sequence
slices of work become its flat tensors (`build_step_inputs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from kiln.ir.types import TensorType

# T: tokens in the step (all sequences flattened); B: sequences; B1: B + 1; MB: max blocks per sequence;
# L: logits rows wanted (usually one per sampling sequence; more for prompt logprobs, none for a step
# that only continues chunked prefills).
STEP_INPUT_TYPES: dict[str, TensorType] = {
    "token_ids": TensorType("i64", ("T",)),
    "positions": TensorType("i64", ("T",)),
    "slot_mapping": TensorType("i64", ("T",)),
    "block_tables": TensorType("i64", ("B", "MB")),
    "seq_lens": TensorType("i64", ("B",)),
    "query_start_loc": TensorType("i64", ("B1",)),
    "logits_indices": TensorType("i64", ("L",)),
}
KV_CACHE_INPUT = "kv_cache"
# The second entry point: the step up to the LM head, returning the final hidden states [L, hidden] of the
# logits_indices rows (passes/embed.py), for embeddings.
EMBED = "embed"
# A vision-language model's step also takes image_rows [E, hidden] (float32): a token id of V + e (V the
# vocabulary size) stands for row e, an image's embedding placed where its placeholder token was.
IMAGE_ROWS_INPUT = "image_rows"
# A model whose image tokens attend to each other both ways (Gemma 3) also takes visible_ends [T] (i64):
# each token's query sees keys at positions < its end (position + 1, or for an image token the end of its
# image, whose tokens are then all in the same step). build_step_inputs makes it with `bidirectional_images`.
VISIBLE_ENDS_INPUT = "visible_ends"
VISIBLE_ENDS_TYPE = TensorType("i64", ("T",))
# A model compiled with LoRA adapters (ops/lora.py) also takes lora_slots [T] (i64: each token's adapter
# slot, -1 for the base model) and, for each adapted module (q_proj, ..., down_proj), the tables
# lora_a.<module> [layers, LS, LR, in] and lora_b.<module> [layers, LS, LR, out] in the activations' dtype:
# LS slots of adapters of rank up to LR, chosen when the runtime allocates them (zero rows past an
# adapter's rank). The runtime owns the tables, as the KV cache, and writes an adapter into a slot.
LORA_SLOTS_INPUT = "lora_slots"
LORA_SLOTS_TYPE = TensorType("i64", ("T",))
LORA_A_PREFIX, LORA_B_PREFIX = "lora_a.", "lora_b."
LORA_SLOTS_DIM, LORA_RANK_DIM = "LS", "LR"
IndexArray = npt.NDArray[np.int64]
Logits = npt.NDArray[np.float32]  # [rows, vocab] on the host: what a step returns, what the sampler reads


def kv_cache_type(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str = "f32") -> TensorType:
    """[layers, 2 (key, value), num_blocks, block_size, kv_heads, head_dim]."""
    return TensorType(dtype, (num_layers, 2, "NB", "BS", num_kv_heads, head_dim))


@dataclass(frozen=True)
class StepInputs:
    """One step's ragged batch: host int64 arrays; an executable moves them where it computes."""

    token_ids: IndexArray
    positions: IndexArray
    slot_mapping: IndexArray
    block_tables: IndexArray
    seq_lens: IndexArray
    query_start_loc: IndexArray
    logits_indices: IndexArray
    image_rows: npt.NDArray[np.float32] | None = None  # a vision-language model's (IMAGE_ROWS_INPUT)
    visible_ends: IndexArray | None = None  # a model with bidirectional images' (VISIBLE_ENDS_INPUT)
    lora_slots: IndexArray | None = None  # a model compiled with LoRA's (LORA_SLOTS_INPUT)
    lora_tables: Mapping[str, Any] | None = None  # its tables by input name, as the runtime holds them

    def as_dict(self) -> dict[str, npt.NDArray[Any]]:
        """The step's inputs by name (image_rows, visible_ends and the LoRA inputs only where given)."""
        arrays = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "lora_tables" and getattr(self, f.name) is not None
        }
        return {**arrays, **(self.lora_tables or {})}


@dataclass(frozen=True)
class SequenceSlice:
    """The tokens one sequence computes in a step, after `num_cached` tokens already in its blocks.

    `logits_at` lists which of these tokens yield a logits row (offsets into `token_ids`, -1 = last);
    empty for a chunk of a prefill that is not finished yet. `image_rows` [k, hidden]: the embeddings of
    the slice's image tokens, at offsets `image_at` (their token ids are then placeholders).
    """

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]
    logits_at: Sequence[int] = (-1,)
    image_at: Sequence[int] = ()
    image_rows: npt.NDArray[np.float32] | None = None
    lora_slot: int = -1  # the slot of the sequence's LoRA adapter, -1 for none


def build_step_inputs(
    slices: Sequence[SequenceSlice],
    block_size: int,
    vocab_size: int | None = None,
    bidirectional_images: bool = False,
    lora: bool = False,
) -> StepInputs:
    """`vocab_size`: where a vision-language model's image rows are numbered from (IMAGE_ROWS_INPUT),
    needed where a slice has image tokens; a step without any has no image_rows. `bidirectional_images`:
    the step has visible_ends, where each run of consecutive image tokens in a slice is one image that
    ends in that slice (the scheduler never cuts a chunk inside one). `lora`: the step has lora_slots, each
    slice's `lora_slot` for its tokens (the tables are the runtime's to add)."""
    token_ids: list[int] = []
    image_rows: list[npt.NDArray[np.float32]] = []
    num_image_rows = 0
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    visible_ends: list[int] = []
    lora_slots: list[int] = []
    for piece in slices:
        seq_len = piece.num_cached + len(piece.token_ids)
        if len(piece.block_table) * block_size < seq_len:
            raise ValueError(f"block table of {len(piece.block_table)} blocks cannot hold {seq_len} tokens")
        if not piece.token_ids:
            raise ValueError("a sequence slice must compute at least one token")
        first_row = len(token_ids)
        for offset, token in enumerate(piece.token_ids):
            position = piece.num_cached + offset
            token_ids.append(token)
            positions.append(position)
            slots.append(piece.block_table[position // block_size] * block_size + position % block_size)
        if piece.image_at:
            if vocab_size is None or piece.image_rows is None or len(piece.image_rows) != len(piece.image_at):
                raise ValueError("image tokens need their rows, one each, and the vocabulary size")
            for k, offset in enumerate(piece.image_at):
                token_ids[first_row + offset] = vocab_size + num_image_rows + k
            image_rows.append(piece.image_rows)
            num_image_rows += len(piece.image_at)
        if bidirectional_images:
            visible_ends += _visible_ends(piece)
        lora_slots += [piece.lora_slot] * len(piece.token_ids)
        logits_indices += [query_start_loc[-1] + (i % len(piece.token_ids)) for i in piece.logits_at]
        seq_lens.append(seq_len)
        query_start_loc.append(len(token_ids))
    width = max(len(p.block_table) for p in slices)
    tables = [list(p.block_table) + [0] * (width - len(p.block_table)) for p in slices]

    def tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> IndexArray:
        return np.array(values, dtype=np.int64)

    return StepInputs(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        seq_lens=tensor(seq_lens),
        query_start_loc=tensor(query_start_loc),
        logits_indices=tensor(logits_indices),
        image_rows=np.concatenate(image_rows).astype(np.float32, copy=False) if image_rows else None,
        visible_ends=tensor(visible_ends) if bidirectional_images else None,
        lora_slots=tensor(lora_slots) if lora else None,
    )


def causal_visible_ends(inputs: StepInputs) -> IndexArray:
    """visible_ends for a step without images: every token sees up to itself."""
    return inputs.positions + 1


def image_spans(positions: Sequence[int] | IndexArray) -> tuple[tuple[int, int], ...]:
    """[start, end) of each run of consecutive image positions (in order): one image each."""
    at = np.asarray(positions, np.int64)
    breaks = np.flatnonzero(np.diff(at) != 1) + 1
    return tuple((int(run[0]), int(run[-1]) + 1) for run in np.split(at, breaks) if len(run))


def _visible_ends(piece: SequenceSlice) -> list[int]:
    """Each token's position + 1, except an image token's: the position after its image's last token."""
    ends = [piece.num_cached + offset + 1 for offset in range(len(piece.token_ids))]
    for start, end in image_spans(piece.image_at):
        ends[start:end] = [piece.num_cached + end] * (end - start)
    return ends
