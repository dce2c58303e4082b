"""The block type of each weight for a llama.cpp mix (passes/quantize/gguf_mix.py) against what llama-quantize
chose: Gemma 3 270M's Q4_K_M file (its rows of 640 values fall back from the K-quants), and tables
llama-quantize wrote on 2026-12-07 (llama.cpp of llama-cpp-python 0.3.36, `llama-quantize F32.gguf OUT.gguf
MIX` on checkpoints made by transformers and converted by convert_hf_to_gguf.py: bench/quantize_parity.py
makes them again and compares every block)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.frontend.gguf_header import gguf_tensors
from kiln.frontend.gguf_loader import config_from_gguf, hf_tensor_name, layer_names, open_gguf
from kiln.passes.base import PassError
from kiln.passes.quantize.gguf_mix import MixModel, mix_types

# GGUF layer tensor → HF module path, as the loader maps them (dense and mixture-of-experts layers)
HF_PATHS = layer_names("llama", qk_norm=False) | layer_names("llama", qk_norm=False, moe=True)
ALL = "all"
# (layers, hidden, ffn, tied, experts, mix) → {llama.cpp tensor: {type: layers}} as llama-quantize wrote them
RECORDED = {
    (12, 256, 768, False, 0, "q4_k_m"): {
        "attn_v": {"Q6_K": [0, 3, 6, 9, 10, 11], "Q4_K": [1, 2, 4, 5, 7, 8]},
        "ffn_down": {"Q6_K": [0, 3, 6, 9, 10, 11], "Q4_K": [1, 2, 4, 5, 7, 8]},
        "attn_q": {"Q4_K": ALL},
        "attn_k": {"Q4_K": ALL},
        "attn_output": {"Q4_K": ALL},
        "ffn_gate": {"Q4_K": ALL},
        "ffn_up": {"Q4_K": ALL},
        "output": "Q6_K",
        "token_embd": "Q4_K",
    },
    (12, 256, 768, False, 0, "q4_0"): {
        **{role: {"Q4_0": ALL} for role in ("attn_q", "attn_k", "attn_v", "attn_output")},
        **{role: {"Q4_0": ALL} for role in ("ffn_gate", "ffn_up", "ffn_down")},
        "output": "Q6_K",
        "token_embd": "Q4_0",
    },
    (9, 320, 640, True, 0, "q4_k_m"): {
        "attn_v": {"Q8_0": [0, 3, 6, 7, 8], "Q5_0": [1, 2, 4, 5]},
        "ffn_down": {"Q8_0": [0, 3, 6, 7, 8], "Q5_0": [1, 2, 4, 5]},
        **{role: {"Q5_0": ALL} for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
        "token_embd": "Q8_0",
    },
    (9, 320, 640, True, 0, "q5_k_m"): {
        "attn_v": {"Q8_0": [0, 3, 6, 7, 8], "Q5_1": [1, 2, 4, 5]},
        "ffn_down": {"Q8_0": [0, 3, 6, 7, 8], "Q5_1": [1, 2, 4, 5]},
        **{role: {"Q5_1": ALL} for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
        "token_embd": "Q8_0",
    },
    (9, 320, 640, True, 0, "q6_k"): {
        **{role: {"Q8_0": ALL} for role in ("attn_q", "attn_k", "attn_v", "attn_output")},
        **{role: {"Q8_0": ALL} for role in ("ffn_gate", "ffn_up", "ffn_down")},
        "token_embd": "Q8_0",
    },
    (4, 256, 768, False, 8, "q4_k_m"): {
        "attn_q": {"Q4_K": ALL},
        "attn_k": {"Q8_0": ALL},
        "attn_v": {"Q8_0": ALL},
        "attn_output": {"Q5_K": ALL},
        "ffn_gate_exps": {"Q4_K": ALL},
        "ffn_up_exps": {"Q4_K": ALL},
        "ffn_down_exps": {"Q4_K": [0, 1], "Q6_K": [2, 3]},
        "output": "Q6_K",
        "token_embd": "Q4_K",
    },
}


def _shapes(layers: int, hidden: int, ffn: int, tied: bool, experts: int) -> dict[str, tuple[int, ...]]:
    """The quantized weights of a Llama (or Mixtral) of these sizes: 4 heads of hidden/4, 2 kv heads."""
    kv = hidden // 2
    layer = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden)}
    layer |= {"attn_output": (hidden, hidden)}
    if experts:
        layer |= {"ffn_gate_exps": (experts, ffn, hidden), "ffn_up_exps": (experts, ffn, hidden)}
        layer |= {"ffn_down_exps": (experts, hidden, ffn)}
    else:
        layer |= {"ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    shapes = {"model.embed_tokens.weight": (320, hidden)}
    if not tied:
        shapes["lm_head.weight"] = (320, hidden)
    for index in range(layers):
        shapes |= {f"model.layers.{index}.{HF_PATHS[role]}.weight": shape for role, shape in layer.items()}
    return shapes


def _expected(recorded: dict, layers: int) -> dict[str, str]:
    expected = {}
    for role, types in recorded.items():
        if isinstance(types, str):
            expected["lm_head.weight" if role == "output" else "model.embed_tokens.weight"] = types
            continue
        for ggml_type, chosen in types.items():
            for index in range(layers) if chosen == ALL else chosen:
                expected[f"model.layers.{index}.{HF_PATHS[role]}.weight"] = ggml_type
    return expected


@pytest.mark.parametrize("case", list(RECORDED), ids=lambda case: "-".join(map(str, case)))
def test_types_are_the_ones_llama_quantize_chose(case: tuple) -> None:
    layers, hidden, ffn, tied, experts, mix = case
    types = mix_types(_shapes(layers, hidden, ffn, tied, experts), mix, MixModel(layers, experts, False))
    assert types == _expected(RECORDED[case], layers)


def test_types_are_gemma_3_270ms_q4_k_m_file() -> None:
    home = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser()
    path = home / "models" / "gemma-3-270m" / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"gemma-3-270m not found at {path}; `make test` fetches it (`kiln pull gemma-3-270m`)")
    quantized = [entry for entry in gguf_tensors(path) if entry.ggml_type not in ("F32", "F16")]  # not norms
    config = config_from_gguf(open_gguf(path), str(path))
    names = {entry.name: hf_tensor_name(entry.name, config, str(path)) for entry in quantized}
    written = {names[entry.name]: entry.ggml_type for entry in quantized}
    shapes = {names[entry.name]: entry.shape for entry in quantized}
    chosen = mix_types(shapes, "q4_k_m", MixModel(layers=18, experts=0, seventy_b=False))
    assert chosen == written
    assert {"Q5_0", "Q8_0", "Q6_K"} <= set(chosen.values())  # rows of 640: the fallbacks are exercised


def test_weights_llama_cpp_has_no_place_for_are_refused_by_name() -> None:
    shapes = _shapes(2, 256, 768, False, 0) | {"model.layers.0.self_attn.qkv_proj.weight": (768, 256)}
    with pytest.raises(PassError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: kiln does not know"):
        mix_types(shapes, "q4_k_m", MixModel(2, 0, False))
    with pytest.raises(PassError, match="rows of 48 values fit no q8_0 block type"):
        mix_types({"lm_head.weight": (320, 48)}, "q8_0", MixModel(1, 0, False))
    with pytest.raises(PassError, match="unknown quantization mix"):
        mix_types({}, "q3_k_m", MixModel(1, 0, False))


def test_a_70b_shaped_llamas_value_weights_take_q5_k() -> None:
    shapes = _shapes(80, 256, 768, False, 0)
    chosen = mix_types(shapes, "q4_k_m", MixModel(80, 0, True))
    assert chosen["model.layers.11.self_attn.v_proj.weight"] == "Q5_K"  # Q4_K elsewhere
    assert chosen["model.layers.12.self_attn.v_proj.weight"] == "Q6_K"  # the more-bits layers stay Q6_K
