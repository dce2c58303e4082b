"""GGUF loading: the real SmolLM2 file against gguf and transformers, and small files written here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from kiln.errors import ModelLoadError, UnsupportedArchitectureError
from kiln.frontend.gguf_loader import _llama3_rope_factors, load_gguf
from kiln.frontend.source import ModelSource, QuantizedTensor
from kiln.ir.deferred import Deferred, materialize

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: Path) -> ModelSource:
    return load_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf_path)


@pytest.fixture(scope="module")
def transformers_state_dict(smollm2_hf: Any) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load of the same file (conftest's `smollm2_hf`)."""
    return smollm2_hf.state_dict()


def llama_cpp_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows of the "llama" architecture."""
    grouped = rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def reverse_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' `LlamaTensorProcessor._reverse_permute_weights`, written out independently."""
    grouped = rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:])
    return grouped.swapaxes(2, 1).reshape(rows.shape)


# ---- the real SmolLM2 file ----------------------------------------------------------------------------


def test_smollm2_config(smollm2: ModelSource) -> None:
    config = smollm2.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert config.rope_scaling.rope_type == "default"
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
    assert config.sliding_window is None
    assert smollm2.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert smollm2.tokenizer.tokenizer_json


def test_smollm2_weight_names(smollm2: ModelSource) -> None:
    names = set(smollm2.weights)
    parts = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    parts += [f"self_attn.{p}_proj" for p in "qkvo"]
    expected = {f"model.layers.{i}.{part}.weight" for i in range(30) for part in parts}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    assert names == expected  # tied: no lm_head

    embed = smollm2.weights["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedTensor)
    assert (embed.ggml_type, embed.shape) == ("Q8_0", (49152, 576))
    assert embed.blocks.dtype == np.uint8 and embed.blocks.shape == (49152, 576 // 32 * 34)
    q_proj = smollm2.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q_proj, QuantizedTensor) and (q_proj.ggml_type, q_proj.shape) == ("Q4_1", (576, 576))
    k_proj = smollm2.weights["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k_proj, QuantizedTensor) and k_proj.shape == (192, 576)
    norm = smollm2.weights["model.norm.weight"]  # read when materialized, as the blocks when imported
    assert isinstance(norm, Deferred) and norm.dtype == torch.float32 and norm.shape == (576,)
    assert norm.materialize().shape == (576,)


def test_smollm2_quantized_tensors_dequantize_like_gguf(
    smollm2: ModelSource, smollm2_reader: gguf.GGUFReader
) -> None:
    by_gguf_name = {t.name: t for t in smollm2_reader.tensors}
    checked = 0
    for name, weight in smollm2.weights.items():
        if not isinstance(weight, QuantizedTensor):
            continue
        tensor = by_gguf_name[_gguf_name(name)]
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj." in name:
            reference = reverse_permute(reference, 9)
        elif ".k_proj." in name:
            reference = reverse_permute(reference, 3)
        assert torch.equal(weight.dequantize(), torch.from_numpy(reference)), name
        checked += 1
    assert checked == 211


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 17, 29])
def test_smollm2_weights_equal_transformers(
    smollm2: ModelSource, transformers_state_dict: dict[str, torch.Tensor], layer: int
) -> None:
    names = [n for n in smollm2.weights if n.startswith(f"model.layers.{layer}.")]
    if layer == 0:
        names += ["model.embed_tokens.weight", "model.norm.weight"]
    assert len(names) >= 9
    for name in names:
        weight = smollm2.weights[name]
        ours = weight.dequantize() if isinstance(weight, QuantizedTensor) else materialize(weight)
        assert torch.equal(ours, transformers_state_dict[name]), name


def _gguf_name(hf_name: str) -> str:
    return _HF_TO_GGUF[hf_name] if hf_name in _HF_TO_GGUF else _layer_gguf_name(hf_name)


_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}


def _layer_gguf_name(hf_name: str) -> str:
    _, _, layer, *part, kind = hf_name.split(".")
    return f"blk.{layer}.{_LAYER_PARTS['.'.join(part)]}.{kind}"


# ---- small files written here -------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 32


def add_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary of VOCAB tokens: three specials, "Ġ" (a space), a-z and two merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ", *"abcdefghijklmnopqrstuvwxyz", "ab", "Ġa"]
    assert len(tokens) == VOCAB
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def tiny_weights(
    bias: bool = False, tied: bool = True, seed: int = 0, qk_norm: bool = False
) -> dict[str, np.ndarray]:
    """Random HF-named float32 weights for a tiny Llama-family model, in torch order."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "mlp.gate_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
        if qk_norm:
            shapes |= {
                prefix + "self_attn.q_norm.weight": (HEAD_DIM,),
                prefix + "self_attn.k_norm.weight": (HEAD_DIM,),
            }
        if bias:
            for proj, heads in ("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS):
                shapes[prefix + f"self_attn.{proj}_proj.bias"] = (heads * HEAD_DIM,)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    arch: str = "llama",
    ggml_type: str = "F32",
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray | tuple[np.ndarray, str]] | None = None,
    name: str = "tiny test model",
) -> Path:
    """Write `weights` as llama.cpp does: GGUF names, "llama" Q/K rows permuted, matrices as `ggml_type`."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    add_tiny_tokenizer(writer)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in weights.items():
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, KV_HEADS)
        _add_tensor(writer, _gguf_name(name), array, ggml_type if array.ndim >= 2 else "F32")
    for name, extra in (extra_tensors or {}).items():  # an array, or (raw blocks, their ggml type)
        if isinstance(extra, tuple):
            writer.add_tensor(name, extra[0], raw_dtype=Q[extra[1]])
        else:
            writer.add_tensor(name, extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, ggml_type: str) -> None:
    if ggml_type == "F32":
        writer.add_tensor(name, array)
    elif ggml_type == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, Q[ggml_type]), raw_dtype=Q[ggml_type])


def test_float_types_round_trip(tmp_path: Path) -> None:
    weights = tiny_weights(tied=False)
    expected_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for ggml_type, dtype in expected_dtype.items():
        path = write_gguf(tmp_path / f"{ggml_type}.gguf", weights, ggml_type=ggml_type)
        source = load_gguf(path)
        assert set(source.weights) == set(weights)
        for name, array in weights.items():
            loaded = source.weights[name]
            assert isinstance(loaded, Deferred)
            loaded = loaded.materialize()
            want = torch.from_numpy(array).to(dtype if array.ndim == 2 else torch.float32)
            assert loaded.dtype == want.dtype and torch.equal(loaded, want), (ggml_type, name)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_types_round_trip(tmp_path: Path, ggml_type: str) -> None:
    weights = tiny_weights()
    source = load_gguf(write_gguf(tmp_path / "q.gguf", weights, ggml_type=ggml_type))
    for name, array in weights.items():
        loaded = source.weights[name]
        if array.ndim == 1:
            assert torch.equal(materialize(loaded), torch.from_numpy(array))
            continue
        assert isinstance(loaded, QuantizedTensor)
        assert (loaded.ggml_type, loaded.shape) == (ggml_type, array.shape)
        blocks = gguf.quants.quantize(array, Q[ggml_type])
        assert np.array_equal(loaded.read(), blocks), name  # the Q/K rows of blocks are back in HF order
        reference = torch.from_numpy(gguf.quants.dequantize(blocks, Q[ggml_type]))
        assert torch.equal(loaded.dequantize(), reference), name


def test_tiny_llama_config(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", tiny_weights(tied=False))
    config = load_gguf(path).config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (VOCAB, HIDDEN, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads) == (HEADS, KV_HEADS)
    assert config.head_dim == HEAD_DIM
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (500000.0, 1e-6, 256)
    assert not config.tie_word_embeddings


def test_qwen2_is_not_permuted_and_has_bias(tmp_path: Path) -> None:
    weights = tiny_weights(bias=True)
    source = load_gguf(write_gguf(tmp_path / "qwen2.gguf", weights, arch="qwen2"))
    assert source.config.architecture == "Qwen2ForCausalLM"
    assert source.config.qkv_bias and not source.config.o_bias
    assert set(source.weights) == set(weights)
    for name, array in weights.items():
        assert torch.equal(materialize(source.weights[name]), torch.from_numpy(array)), name


def test_qwen3_has_per_head_q_and_k_norms(tmp_path: Path) -> None:
    weights = tiny_weights(qk_norm=True)
    source = load_gguf(write_gguf(tmp_path / "qwen3.gguf", weights, arch="qwen3"))
    assert source.config.architecture == "Qwen3ForCausalLM"
    assert source.config.qk_norm and not source.config.qkv_bias
    assert set(source.weights) == set(weights)
    for name, array in weights.items():
        assert torch.equal(materialize(source.weights[name]), torch.from_numpy(array)), name


EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 32


def with_experts(weights: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """`weights` with each layer's MLP a router and 4 stacked experts (GGUF's `ffn_*_exps`)."""
    rng = np.random.default_rng(seed)
    moe = {name: array for name, array in weights.items() if ".mlp." not in name}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}.mlp."
        shapes = {
            "gate.weight": (EXPERTS, HIDDEN),
            "experts.gate_proj.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
            "experts.up_proj.weight": (EXPERTS, EXPERT_FFN, HIDDEN),
            "experts.down_proj.weight": (EXPERTS, HIDDEN, EXPERT_FFN),
        }
        moe |= {
            prefix + name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
        }
    return moe


@pytest.mark.parametrize(
    ("arch", "architecture", "normalized", "whole_norms"),
    [
        ("llama", "MixtralForCausalLM", True, False),
        ("qwen3moe", "Qwen3MoeForCausalLM", True, False),
        ("olmoe", "OlmoeForCausalLM", False, True),
    ],
)
def test_mixture_of_experts(
    tmp_path: Path, arch: str, architecture: str, normalized: bool, whole_norms: bool
) -> None:
    weights = with_experts(tiny_weights(qk_norm=arch != "llama"))
    if whole_norms:  # OLMoE's q and k norms span every head
        for i in range(LAYERS):
            weights[f"model.layers.{i}.self_attn.q_norm.weight"] = np.ones(HEADS * HEAD_DIM, np.float32)
            weights[f"model.layers.{i}.self_attn.k_norm.weight"] = np.ones(KV_HEADS * HEAD_DIM, np.float32)
    metadata = {f"{arch}.expert_count": EXPERTS, f"{arch}.expert_used_count": EXPERTS_USED}
    if arch == "qwen3moe":
        metadata[f"{arch}.expert_feed_forward_length"] = EXPERT_FFN
    source = load_gguf(write_gguf(tmp_path / f"{arch}.gguf", weights, arch=arch, metadata=metadata))
    config = source.config
    assert config.architecture == architecture
    assert (config.num_experts, config.num_experts_per_tok) == (EXPERTS, EXPERTS_USED)
    assert config.norm_topk_prob is normalized and config.qk_norm_whole is whole_norms
    assert all(config.is_moe(layer) for layer in range(LAYERS))
    assert set(source.weights) == set(weights)
    for name in weights:
        if ".mlp." in name:
            assert torch.equal(materialize(source.weights[name]), torch.from_numpy(weights[name])), name


def test_quantized_experts_stay_blocks(tmp_path: Path) -> None:
    weights = with_experts(tiny_weights())
    metadata = {"llama.expert_count": EXPERTS, "llama.expert_used_count": EXPERTS_USED}
    path = write_gguf(tmp_path / "mixtral.gguf", weights, metadata=metadata, ggml_type="Q8_0")
    experts = load_gguf(path).weights["model.layers.0.mlp.experts.down_proj.weight"]
    assert isinstance(experts, QuantizedTensor) and experts.ggml_type == "Q8_0"
    assert experts.shape == (EXPERTS, HIDDEN, EXPERT_FFN)
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(weights["model.layers.0.mlp.experts.down_proj.weight"], Q.Q8_0), Q.Q8_0
    )
    assert torch.equal(experts.dequantize(), torch.from_numpy(expected))


def test_experts_without_a_used_count_are_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "moe.gguf", with_experts(tiny_weights()), metadata={"llama.expert_count": 4})
    with pytest.raises(ModelLoadError, match="expert_used_count"):
        load_gguf(path)


def _fused_phi3(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    fused = {}
    for name, array in weights.items():
        if ".q_proj." in name:
            parts = [weights[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            fused[name.replace("q_proj", "qkv_proj")] = np.concatenate(parts)
        elif ".gate_proj." in name:
            fused[name.replace("gate_proj", "gate_up_proj")] = np.concatenate(
                [array, weights[name.replace("gate", "up")]]
            )
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            fused[name] = array
    return fused


@pytest.mark.parametrize("ggml_type", ["F32", "Q8_0"])
def test_phi3_fused_weights_are_split(tmp_path: Path, ggml_type: str) -> None:
    weights = tiny_weights()
    source = load_gguf(
        write_gguf(tmp_path / "phi3.gguf", _fused_phi3(weights), arch="phi3", ggml_type=ggml_type)
    )
    assert source.config.architecture == "Phi3ForCausalLM"
    assert set(source.weights) == set(weights)
    reference = load_gguf(write_gguf(tmp_path / "llama.gguf", weights, arch="qwen2", ggml_type=ggml_type))
    for name in weights:
        ours, theirs = source.weights[name], reference.weights[name]
        if isinstance(theirs, Deferred):
            assert torch.equal(materialize(ours), theirs.materialize()), name
        else:
            assert ours.shape == theirs.shape and np.array_equal(ours.read(), theirs.read()), name


def test_longrope_factors_and_attention_factor(tmp_path: Path) -> None:
    short, long = np.linspace(1, 2, HEAD_DIM // 2), np.linspace(1, 8, HEAD_DIM // 2)
    factors = {
        "rope_factors_short.weight": short.astype(np.float32),
        "rope_factors_long.weight": long.astype(np.float32),
    }
    metadata = {"phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": 1.19}
    path = write_gguf(
        tmp_path / "phi3.gguf",
        _fused_phi3(tiny_weights()),
        arch="phi3",
        extra_tensors=factors,
        metadata=metadata,
    )
    source = load_gguf(path)
    scaling = source.config.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", 64)
    assert np.allclose(scaling.short_factor, short) and np.allclose(scaling.long_factor, long)
    assert scaling.attention_factor == pytest.approx(1.19)
    assert not any("rope_factors" in name for name in source.weights)


def test_longrope_without_its_original_context_is_refused(tmp_path: Path) -> None:
    factors = {"rope_factors_long.weight": np.ones(HEAD_DIM // 2, np.float32)}
    path = write_gguf(tmp_path / "phi3.gguf", _fused_phi3(tiny_weights()), arch="phi3", extra_tensors=factors)
    with pytest.raises(ModelLoadError, match="longrope needs both rope factor tensors"):
        load_gguf(path)


def test_llama_bias_is_unpermuted(tmp_path: Path) -> None:
    weights = tiny_weights(bias=True)
    source = load_gguf(write_gguf(tmp_path / "bias.gguf", weights))
    assert source.config.qkv_bias
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(materialize(source.weights[name]), torch.from_numpy(weights[name])), name


def test_mistral_is_stored_as_llama(tmp_path: Path) -> None:
    meta = {"llama.attention.sliding_window": 4096}
    name = "Mistral 7B Instruct v0.3"
    path = write_gguf(tmp_path / "m.gguf", tiny_weights(), metadata=meta, name=name)
    source = load_gguf(path)
    assert source.name == name
    assert source.config.architecture == "MistralForCausalLM"
    assert source.config.sliding_window == 4096


def test_linear_rope_scaling(tmp_path: Path) -> None:
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "r.gguf", tiny_weights(), metadata=meta)
    config = load_gguf(path).config
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 4.0)


def test_yarn_rope_scaling_is_refused(tmp_path: Path) -> None:
    meta = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "r.gguf", tiny_weights(), metadata=meta)
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn' is not supported") as error:
        load_gguf(path)
    assert error.value.hint and "linear" in error.value.hint


def llama3_rope_factors(factor: float, theta: float = 500000.0, old_context_len: int = 8192) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, with Llama 3's defaults."""
    low_freq_factor, high_freq_factor = 1.0, 4.0
    freqs = 1.0 / (theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high_freq_factor:
            factors.append(1)
        elif wavelen > old_context_len / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    rope_freqs = llama3_rope_factors(8.0)
    assert rope_freqs.min() == 1.0 and rope_freqs.max() == 8.0
    extra = {"rope_freqs.weight": rope_freqs}
    path = write_gguf(tmp_path / "l3.gguf", tiny_weights(), extra_tensors=extra)
    source = load_gguf(path)
    scaling = source.config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert scaling.original_max_position_embeddings == 8192
    assert "rope_freqs.weight" not in source.weights


@pytest.mark.parametrize("original", [32, 100, 2048])
def test_llama3_rope_scaling_of_another_original_context(tmp_path: Path, original: int) -> None:
    """The file does not say the original context: the factors give it (2048 scales a frequency part-way,
    which fixes it; 32 and 100 leave each either unscaled or scaled by the whole factor, and any context
    that reproduces the factors runs the same)."""
    rope_freqs = llama3_rope_factors(8.0, old_context_len=original)
    path = write_gguf(tmp_path / "l3.gguf", tiny_weights(), extra_tensors={"rope_freqs.weight": rope_freqs})
    scaling = load_gguf(path).config.rope_scaling
    assert (scaling.rope_type, scaling.factor) == ("llama3", 8.0)
    recovered = _llama3_rope_factors(scaling, HEAD_DIM, 500000.0)
    np.testing.assert_allclose(recovered, rope_freqs, rtol=1e-5)
    if original == 2048:
        assert scaling.original_max_position_embeddings == original


def test_unrecognised_rope_freqs_are_refused(tmp_path: Path) -> None:
    extra = {"rope_freqs.weight": np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)}
    path = write_gguf(tmp_path / "l3.gguf", tiny_weights(), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="rope_freqs tensor does not match llama3 rope scaling"):
        load_gguf(path)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_unsupported_architecture(tmp_path: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_weights(), arch=arch)
    message = f"architecture '{arch}' is not supported"
    with pytest.raises(UnsupportedArchitectureError, match=message) as error:
        load_gguf(path)
    assert error.value.hint and "llama" in error.value.hint and "qwen2" in error.value.hint


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    weights = tiny_weights()
    path = tmp_path / "f64.gguf"
    extra = {"blk.0.ffn_up.weight": weights.pop("model.layers.0.mlp.up_proj.weight").astype(np.float64)}
    write_gguf(path, weights, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.ffn_up\.weight' has type F64"):
        load_gguf(path)


@pytest.mark.parametrize("ggml_type", ["IQ4_NL", "TQ2_0", "MXFP4"])
def test_types_kiln_does_not_run_are_refused_naming_tensor_type_and_remedy(
    tmp_path: Path, ggml_type: str
) -> None:
    weights = tiny_weights()
    up = weights.pop("model.layers.0.mlp.up_proj.weight")
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q[ggml_type]]
    rows, k = up.shape[0], max(up.shape[1], block_values)
    raw = np.zeros((rows, k // block_values * block_bytes), dtype=np.uint8)
    path = tmp_path / f"{ggml_type}.gguf"
    write_gguf(path, weights, extra_tensors={"blk.0.ffn_up.weight": (raw, ggml_type)})
    with pytest.raises(
        ModelLoadError, match=rf"tensor 'blk\.0\.ffn_up\.weight' has type {ggml_type}"
    ) as error:
        load_gguf(path)
    assert "Q4_K_M" in str(error.value.hint)


def test_unexpected_tensor(tmp_path: Path) -> None:
    extra = {"blk.0.ssm_conv1d.weight": np.ones(HEAD_DIM, np.float32)}  # a Mamba tensor
    path = write_gguf(tmp_path / "ssm.gguf", tiny_weights(), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'blk\.0\.ssm_conv1d\.weight'"):
        load_gguf(path)


def test_missing_layer_weights(tmp_path: Path) -> None:
    weights = tiny_weights()
    del weights["model.layers.1.mlp.down_proj.weight"]
    path = write_gguf(tmp_path / "incomplete.gguf", weights)
    with pytest.raises(ModelLoadError, match=r"lacks weights .*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(path)


# ---- broken and missing files -------------------------------------------------------------------------


@pytest.fixture
def truncated(tmp_path: Path, smollm2_gguf_path: Path) -> Iterator[Any]:
    def cut(size: int) -> Path:
        path = tmp_path / f"cut-{size}.gguf"
        with smollm2_gguf_path.open("rb") as source, path.open("wb") as target:
            target.write(source.read(size))
        return path

    yield cut


@pytest.mark.parametrize("where", ["header", "metadata", "tensor data"])
def test_truncated(truncated: Any, smollm2_reader: gguf.GGUFReader, where: str) -> None:
    tensor = smollm2_reader.tensors[100]
    size = {
        "header": 10,
        "metadata": 1 << 20,
        "tensor data": int(tensor.data_offset) + int(tensor.n_bytes) // 2,
    }
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF file") as error:
        load_gguf(truncated(size[where]))
    assert error.value.hint == "download the file again"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_gguf(tmp_path / "absent.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory"):
        load_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"hello, this is not a model\n"])
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "text.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("ggml_type", ["F16", "Q8_0"])
def test_weights_are_read_from_the_file_when_needed(tmp_path: Path, ggml_type: str) -> None:
    """Loading reads no weight; a weight read is a copy, which the file changing afterwards keeps."""
    path = write_gguf(tmp_path / "tiny.gguf", tiny_weights(), ggml_type=ggml_type)
    source = load_gguf(path)
    before = {name: materialize(w) for name, w in source.float_weights().items()}
    data_offset = gguf.GGUFReader(path).data_offset
    with path.open("r+b") as file:
        file.seek(data_offset)
        file.write(bytes(path.stat().st_size - data_offset))
    assert all(torch.count_nonzero(before[name]) for name in before)
    after = {name: materialize(w) for name, w in source.float_weights().items()}
    assert not any(torch.count_nonzero(after[name]) for name in after)


def test_metadata_that_does_not_fit_the_tensors(tmp_path: Path) -> None:
    meta = {"llama.attention.key_length": HEAD_DIM // 2}
    path = write_gguf(tmp_path / "bad.gguf", tiny_weights(), metadata=meta)
    with pytest.raises(
        ModelLoadError, match=r"q_proj\.weight has 64 rows, but the metadata's heads × head_dim is 32"
    ):
        load_gguf(path)


@pytest.mark.parametrize(("pooling_type", "pooling"), [(None, None), (1, "mean"), (3, "last"), (2, None)])
def test_pooling_type_is_read(tmp_path: Path, pooling_type: int | None, pooling: str | None) -> None:
    metadata = {} if pooling_type is None else {"llama.pooling_type": pooling_type}
    path = write_gguf(tmp_path / "tiny.gguf", tiny_weights(tied=False), metadata=metadata)
    assert load_gguf(path).config.pooling == pooling
