"""Which GGUF block type each weight gets for a llama.cpp quantization mix (`--quantization q4_k_m`, ...):
llama-quantize's choice without an importance matrix, read from its tensor-type rules (llama-quant.cpp,
llama.cpp as vendored in llama-cpp-python 0.3.36), for the tensors a dense or mixture-of-experts
decoder has. Weights are named as in the HF checkpoint; a weight this does not place is refused by name
rather than given a type llama.cpp might not give it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.ir import Program
from kiln.passes.base import GGUF_MIXES, PassError
from kiln.passes.quantize.gguf_encode import EncodedTensor, block_size
from kiln.passes.quantize.swap import quantizable_weights

# mix → the type of every tensor no rule moves (llama_ftype_get_default_type)
MIXES = dict(zip(GGUF_MIXES, ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"), strict=True))
# a 256-value type on rows it does not divide (tensor_type_fallback)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# HF module path in a decoder layer → llama.cpp's tensor category
_LAYER_ROLES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.experts.gate_proj": "ffn_gate",
    "mlp.experts.up_proj": "ffn_up",
    "mlp.experts.down_proj": "ffn_down",
}
_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_GLOBAL_ROLES = {"model.embed_tokens.weight": "token_embd", "lm_head.weight": "output"}


@dataclass(frozen=True)
class MixModel:
    """What llama-quantize's choice reads of the model besides each tensor's name and shape."""

    layers: int
    experts: int  # 0 for a dense model
    seventy_b: bool  # llama.cpp's LLM_TYPE_70B (80 layers: Llama with grouped-query attention, Qwen2)


def _more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp gives more bits: the first and last eighth, and every third in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _role(name: str) -> tuple[str, int] | None:
    """(llama.cpp category, layer or -1) of a weight, None where it has no place in a GGUF decoder."""
    if name in _GLOBAL_ROLES:
        return _GLOBAL_ROLES[name], -1
    found = _LAYER_WEIGHT.match(name)
    if found is None or found.group(2) not in _LAYER_ROLES:
        return None
    return _LAYER_ROLES[found.group(2)], int(found.group(1))


def _chosen(
    mix: str, role: str, layer: int, columns: int, tied: bool, model: MixModel, value: tuple[int, int]
) -> str:
    """`value`: (this one's index, how many) among the attention value weights."""
    default = MIXES[mix]
    grouped_experts = model.experts == 8
    chosen = default
    if role == "output" or (tied and role == "token_embd"):
        chosen = "Q8_0" if columns % block_size(default) or default == "Q8_0" else "Q6_K"
    elif role == "attn_v":
        if mix in ("q4_k_m", "q5_k_m") and _more_bits(*value):
            chosen = "Q6_K"
        if model.seventy_b and chosen == "Q4_K":
            chosen = "Q5_K"
        if grouped_experts:
            chosen = "Q8_0"
    elif role == "attn_k" and grouped_experts:
        chosen = "Q8_0"
    elif role == "ffn_down" and mix in ("q4_k_m", "q5_k_m") and _more_bits(layer, model.layers):
        chosen = "Q6_K"
    elif role == "attn_output" and grouped_experts and mix == "q4_k_m":
        chosen = "Q5_K"
    if columns % block_size(chosen):
        chosen = _FALLBACK.get(chosen, chosen)
    return chosen


def mix_types(shapes: Mapping[str, tuple[int, ...]], mix: str, model: MixModel) -> dict[str, str]:
    """The block type of each weight in `shapes` (the weights the gguf import would take: linears,
    stacked experts, the embedding and the LM head) for `mix`, as llama-quantize gives them."""
    if mix not in MIXES:
        raise PassError(f"unknown quantization mix {mix!r}", hint=f"one of {', '.join(MIXES)}")
    roles = {}
    for name in shapes:
        role = _role(name)
        if role is None:
            raise PassError(
                f"weight {name}: kiln does not know which block type llama-quantize gives it",
                hint="use --quantization int8 or int4 for this model, or llama.cpp's own GGUF of it",
            )
        roles[name] = role
    tied = "lm_head.weight" not in shapes
    value_layers = sorted(layer for role, layer in roles.values() if role == "attn_v")
    v_index = {layer: index for index, layer in enumerate(value_layers)}  # llama.cpp counts them in order
    types = {}
    for name, (role, layer) in roles.items():
        columns = shapes[name][-1]
        chosen = _chosen(mix, role, layer, columns, tied, model, (v_index.get(layer, 0), len(value_layers)))
        if columns % block_size(chosen):
            raise PassError(
                f"weight {name}: rows of {columns} values fit no {mix} block type (llama.cpp keeps it f16)",
                hint="use --quantization int8 for this model",
            )
        types[name] = chosen
    return types


def encoded_blocks(program: Program, mix: str, model: MixModel) -> dict[str, EncodedTensor]:
    """Every weight the gguf import takes from `program`, as `mix`'s blocks, encoded when read."""
    names = sorted(quantizable_weights(program))
    shapes = {name: tuple(program.weights[name].shape) for name in names}
    return {
        name: EncodedTensor(ggml_type, program.weights[name])
        for name, ggml_type in mix_types(shapes, mix, model).items()
    }
