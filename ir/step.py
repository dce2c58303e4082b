"""The step contract: what a compiled model's step takes (`StepSignature`: every input by name, the
optional ones a model takes, its entry points), one step's inputs (`StepInputs`), the one place where
inputs a step was not given are filled (`fill_absent`), and how per-sequence slices of work become a
step's flat tensors (`build_step_inputs`). See docs/design.md, "The step"."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
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
# Entry points: `step` returns logits [L, vocab]; `decode` is `step` specialised by a backend for one
# block of rows; `embed` is the step up to the LM head, returning the final hidden states [L, hidden] of
# the logits_indices rows (passes/embed.py), for embeddings.
STEP, DECODE, EMBED = "step", "decode", "embed"
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
    """One step's ragged batch: the contract's host int64 arrays, and the optional inputs given by name
    (`optional`: image_rows, visible_ends, lora_slots, the LoRA tables as the runtime holds them, ...); an
    executable moves them where it computes and fills those it takes but was not given (`fill_absent`)."""

    token_ids: IndexArray
    positions: IndexArray
    slot_mapping: IndexArray
    block_tables: IndexArray
    seq_lens: IndexArray
    query_start_loc: IndexArray
    logits_indices: IndexArray
    optional: Mapping[str, Any] = field(default_factory=dict)

    @property
    def image_rows(self) -> npt.NDArray[np.float32] | None:
        return self.optional.get(IMAGE_ROWS_INPUT)

    @property
    def visible_ends(self) -> IndexArray | None:
        return self.optional.get(VISIBLE_ENDS_INPUT)

    @property
    def lora_slots(self) -> IndexArray | None:
        return self.optional.get(LORA_SLOTS_INPUT)

    @property
    def lora_tables(self) -> dict[str, Any]:
        """The LoRA tables given, by input name."""
        return {n: a for n, a in self.optional.items() if n.startswith((LORA_A_PREFIX, LORA_B_PREFIX))}

    def with_optional(self, named: Mapping[str, Any]) -> StepInputs:
        """These inputs with `named` optional ones added (or replaced); a None value removes one."""
        merged = {**self.optional, **named}
        return replace(self, optional={n: a for n, a in merged.items() if a is not None})

    def without(self, *prefixes: str) -> StepInputs:
        """These inputs without the optional ones whose names start with one of `prefixes`."""
        return replace(self, optional={n: a for n, a in self.optional.items() if not n.startswith(prefixes)})

    def as_dict(self) -> dict[str, Any]:
        """Every input given, by name."""
        required = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "optional"}
        return {**required, **self.optional}


AbsentValue = Callable[[TensorType, StepInputs, str], Any]  # (its type, the step's inputs, device)


@dataclass(frozen=True)
class OptionalInput:
    """An input that only some models' steps take, declared once: the input `name` (with `is_prefix`,
    every input named `name` + something: one table each of a family), `absent`: what a step that was
    not given it passes (the model then computes as without it), and `row_fill`: the value of a padding
    row, for a backend that pads token rows (ignored for inputs without T rows). `runtime_owned`: the
    runtime allocates it once and writes it in place, like the KV cache (a backend keeps views of it)."""

    name: str
    absent: AbsentValue
    row_fill: int = 0
    is_prefix: bool = False
    runtime_owned: bool = False

    def matches(self, input_name: str) -> bool:
        return input_name.startswith(self.name) if self.is_prefix else input_name == self.name


def zeros(tensor_type: TensorType, sizes: Mapping[str, int], device: str = "cpu") -> Any:
    """Zeros of `tensor_type`, its symbolic dims given by `sizes`: a numpy array on the host, a torch
    tensor on a GPU."""
    shape = tuple(d if isinstance(d, int) else sizes[d] for d in tensor_type.shape)
    if device.split(":")[0] != "cpu":
        import torch

        from kiln.ir.types import DTYPES

        return torch.zeros(shape, dtype=DTYPES[tensor_type.dtype], device=device)
    from kiln.ir.host_arrays import HOST_DTYPES

    return np.zeros(shape, HOST_DTYPES[tensor_type.dtype])


@functools.lru_cache(maxsize=64)
def _one_zero_slot(tensor_type: TensorType, device: str) -> Any:
    """A LoRA table of one zero slot of rank 1 (no slot matches -1: every row on the base model), made
    once per table type and device: a backend keeps views of the tables it is given by identity."""
    return zeros(tensor_type, {LORA_SLOTS_DIM: 1, LORA_RANK_DIM: 1}, device)


def _every_row(value: int) -> AbsentValue:
    return lambda _type, inputs, _device: np.full(inputs.token_ids.shape, value, np.int64)


# In the order a step takes them (after the contract's inputs and kv_cache); a new optional input is
# declared here (or by `declare_optional_input`) and produced where the runtime builds a step.
OPTIONAL_INPUTS: list[OptionalInput] = [
    OptionalInput(IMAGE_ROWS_INPUT, lambda t, _inputs, _device: zeros(t, {"E": 0})),
    OptionalInput(VISIBLE_ENDS_INPUT, lambda _t, inputs, _device: inputs.positions + 1, row_fill=1),
    OptionalInput(LORA_SLOTS_INPUT, _every_row(-1), row_fill=-1),
    OptionalInput(LORA_A_PREFIX, lambda t, _i, device: _one_zero_slot(t, device), True, True, True),
    OptionalInput(LORA_B_PREFIX, lambda t, _i, device: _one_zero_slot(t, device), True, True, True),
]


def declare_optional_input(entry: OptionalInput) -> None:
    """Declare one more optional input (after those declared already)."""
    if any(known.name == entry.name for known in OPTIONAL_INPUTS):
        raise ValueError(f"optional input {entry.name!r} is declared already")
    OPTIONAL_INPUTS.append(entry)


def optional_input(name: str) -> OptionalInput:
    """The declaration of an optional input, by the input's name."""
    for entry in OPTIONAL_INPUTS:
        if entry.matches(name):
            return entry
    raise KeyError(f"{name!r} is not a step input: the contract's are {', '.join(STEP_INPUT_TYPES)}")


@dataclass(frozen=True)
class StepSignature:
    """What a compiled step takes and offers: every input by name and type in the order its function
    takes them (the contract's, kv_cache, then the optional ones this model takes), its entry points
    (`step`, `decode`, `embed`) and the width of `embed`'s rows. Built once from the graph at compile,
    written into the artifact, read at load (`to_fields` / `from_fields`)."""

    inputs: tuple[tuple[str, TensorType], ...]
    entry_points: tuple[str, ...] = (STEP,)
    embedding_size: int | None = None

    @classmethod
    def of_graph(
        cls, graph: Any, entry_points: Sequence[str] = (STEP,), embedding_size: int | None = None
    ) -> StepSignature:
        """The signature of `graph`'s step (an ir.Graph), its inputs in the graph's order; an input that
        is neither the contract's nor declared is refused."""
        inputs = tuple((value.name, value.type) for value in graph.inputs)
        for name, _ in inputs:
            if name not in STEP_INPUT_TYPES and name != KV_CACHE_INPUT:
                optional_input(name)
        return cls(inputs, tuple(entry_points), embedding_size)

    @functools.cached_property
    def types(self) -> dict[str, TensorType]:
        return dict(self.inputs)

    def takes(self, name: str) -> bool:
        return name in self.types

    def has(self, entry_point: str) -> bool:
        return entry_point in self.entry_points

    @functools.cached_property
    def optional(self) -> tuple[str, ...]:
        """The optional inputs this step takes, in order."""
        return tuple(n for n, _ in self.inputs if n not in STEP_INPUT_TYPES and n != KV_CACHE_INPUT)

    @functools.cached_property
    def row_fills(self) -> dict[str, int]:
        """Each input with a row per token (T) or per logits row (L): the value of a padding row, for a
        backend that pads rows (the contract's padding rows write no K/V: slot -1)."""
        contract = {"slot_mapping": -1}
        return {
            name: contract.get(name, 0) if name in STEP_INPUT_TYPES else optional_input(name).row_fill
            for name, tensor_type in self.inputs
            if tensor_type.rank >= 1 and tensor_type.shape[0] in ("T", "L")
        }

    def runtime_owned(self, name: str) -> bool:
        """Whether the runtime owns that input (allocated once, written in place, like the KV cache)."""
        return name in self.optional and optional_input(name).runtime_owned

    @property
    def kv_cache(self) -> TensorType:
        return self.types[KV_CACHE_INPUT]

    def with_entry_points(self, entry_points: Sequence[str], embedding_size: int | None) -> StepSignature:
        return replace(self, entry_points=tuple(entry_points), embedding_size=embedding_size)

    def to_fields(self) -> dict[str, Any]:
        """The artifact's record (JSON)."""
        return {
            "inputs": [[name, tensor_type.text()] for name, tensor_type in self.inputs],
            "entry_points": list(self.entry_points),
            "embedding_size": self.embedding_size,
        }

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> StepSignature:
        inputs = tuple((str(name), TensorType.parse(text)) for name, text in record["inputs"])
        return cls(inputs, tuple(record["entry_points"]), record.get("embedding_size"))


def fill_absent(inputs: StepInputs, signature: StepSignature, device: str = "cpu") -> StepInputs:
    """`inputs` with each optional input that `signature` takes but `inputs` lacks filled as its
    declaration says (the step then computes as without it). The one place absent inputs are filled, for
    every backend; `device`: where runtime-owned ones must live. Refused (ValueError): an input the step
    does not take, a row input without a row for each token, or some of the runtime-owned inputs
    without the rest (the tables come together)."""
    given = inputs.optional
    unknown = [name for name in given if not signature.takes(name)]
    if unknown:
        raise ValueError(f"this step takes no {', '.join(unknown)} (it takes {', '.join(signature.types)})")
    for name, array in given.items():
        rows = signature.types[name].shape[0] if signature.types[name].rank else None
        if rows == "T" and len(array) != len(inputs.token_ids):
            raise ValueError(
                f"{name} has {len(array)} rows, not one for each of the {len(inputs.token_ids)} tokens"
            )
    missing = [name for name in signature.optional if name not in given]
    owned_missing = [name for name in missing if signature.runtime_owned(name)]
    if owned_missing and any(signature.runtime_owned(name) for name in given):
        raise ValueError(f"the step's tables lack {', '.join(owned_missing)}")
    if not missing:
        return inputs
    filled = {name: optional_input(name).absent(signature.types[name], inputs, device) for name in missing}
    return inputs.with_optional(filled)


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

    optional: dict[str, Any] = {}
    if image_rows:
        optional[IMAGE_ROWS_INPUT] = np.concatenate(image_rows).astype(np.float32, copy=False)
    if bidirectional_images:
        optional[VISIBLE_ENDS_INPUT] = tensor(visible_ends)
    if lora:
        optional[LORA_SLOTS_INPUT] = tensor(lora_slots)
    return StepInputs(
        token_ids=tensor(token_ids),
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        block_tables=tensor(tables),
        seq_lens=tensor(seq_lens),
        query_start_loc=tensor(query_start_loc),
        logits_indices=tensor(logits_indices),
        optional=optional,
    )


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
