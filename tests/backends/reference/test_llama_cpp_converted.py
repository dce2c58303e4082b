"""Each family's tiny model (tests/backends/conftest.py), converted to GGUF by llama.cpp's own
`convert_hf_to_gguf.py` with llama.cpp's own gguf-py (scripts/llama_cpp_source.sh fetches them; `make
test` does): Kiln's GGUF loader reads the file someone else wrote, and the reference backend gives
transformers' logits on the HF model it came from, within 1e-4, on the ragged batch (for the
converter's Q8_0 files, the HF model with its weights rounded to Q8_0 by gguf-py). A misread llama.cpp
convention (a Q/K permutation, Gemma's norm offset, fused or stacked tensors, rope factors) fails here.

What a GGUF cannot say is set so that the HF model and llama.cpp's reading of its file agree:
- a byte-level BPE tokenizer of 320 tokens (the converter reads the tokenizer too), special ids in it;
- Qwen3-MoE: experts in every layer (llama.cpp's qwen3moe has no dense layers: its converter cannot map
  one);
- Gemma 3: attention scaled by 1/sqrt(head_dim), every layer sliding-window (llama.cpp makes every 6th
  layer global and derives the scale; the file has no key for either);
- OLMoE: as many kv heads as query heads (llama.cpp's olmoe takes the k norm over the whole hidden size);
- Mistral with a sliding window: the `llama` GGUF has no window, so the file means full attention (as
  llama.cpp runs it) and is compared with the HF model with its window off.

Converted files are cached in $KILN_HOME/models/converted, keyed by the HF folder's bytes and the
converter's version.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.gguf_tokenizer import _byte_alphabet
from kiln.frontend.load import load_model
from kiln.frontend.pull import kiln_home

REPO = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-4  # max |ours - HF| / max |HF|, float32 files
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
VOCAB = 320  # 256 bytes, 63 merges, <|endoftext|>
END = "<|endoftext|>"
FAMILIES = [
    "llama",
    "llama_tied",
    "llama3_rope",
    "mistral_window",
    "qwen2",
    "qwen3",
    "phi3",
    "phi3_longrope",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "olmoe",
]
EXPRESSIBLE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"mlp_only_layers": []},
    "gemma3": {"query_pre_attn_scalar": 32, "layer_types": ["sliding_attention", "sliding_attention"]},
    "olmoe": {"num_key_value_heads": 4},
}


def save_byte_level_tokenizer(folder: Path) -> None:
    """A GPT-2 style tokenizer (the converter's BPE path for every family): each byte a token, 63 merges."""
    alphabet = _byte_alphabet()
    merges = [(a, b) for a in "abcdefgh" for b in "abcdefgh"][:63]
    vocab = {alphabet[byte]: byte for byte in range(256)}
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    vocab[END] = VOCAB - 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("added_tokens_decoder", None)
    # Phi-3's converter reads a GPT-2 tokenizer only when told so; GPT-2's class defaults its special
    # tokens to <|endoftext|>, in the vocabulary here
    config.update(tokenizer_class="GPT2Tokenizer", bos_token=END, eos_token=END, unk_token=END)
    config_path.write_text(json.dumps(config))


def convert(source: Path, hf: Path, outtype: str, cache: Path) -> Path:
    """The GGUF llama.cpp's converter writes for `hf` (cached by the folder's bytes)."""
    digest = hashlib.sha256(f"{source.parents[1].name} {outtype}".encode())
    for path in sorted(hf.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    out = cache / f"{hf.name}-{outtype}-{digest.hexdigest()[:16]}.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    wrapper = REPO / "scripts" / "llama_cpp_convert.py"
    command = [sys.executable, str(wrapper), str(source), "gpt-2", str(hf), "--outfile", str(partial)]
    result = subprocess.run([*command, "--outtype", outtype], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    partial.rename(out)
    return out


def ragged_logits(executable: ReferenceExecutable, ragged) -> tuple[dict[str, list[int]], torch.Tensor]:
    tokens, first, second = ragged(1234)
    cache = executable.kv_cache_spec.allocate(10, 16)
    executable.step(first, cache)
    return tokens, torch.from_numpy(executable.step(second, cache))


def round_trip_q8_0(model: torch.nn.Module) -> None:
    """Each weight the converter writes as Q8_0 (rows of a multiple of 32; not the MoE router, which it
    keeps in float32) quantized and dequantized along its rows by gguf-py, as the file holds it."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim >= 2 and weight.shape[-1] % 32 == 0 and not name.endswith(ROUTERS):
                rounded = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), q8_0), q8_0)
                weight.copy_(torch.from_numpy(rounded))


def check_family(kind: str, outtype: str, folder: Path, tiny_hf, ragged, source: Path) -> None:
    hf = folder / kind
    overrides = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    model = tiny_hf(kind, hf, {**overrides, **EXPRESSIBLE.get(kind, {})})
    save_byte_level_tokenizer(hf)
    gguf_path = convert(source, hf, outtype, kiln_home() / "models" / "converted")
    loaded = load_model(str(gguf_path))
    if kind == "mistral_window":
        assert loaded.config.sliding_window is None
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, sliding_window=None).eval()
    if outtype == "q8_0":
        round_trip_q8_0(model)
    captured = capture_weights(loaded.config, loaded.float_weights())
    tokens, logits = ragged_logits(ReferenceExecutable(captured.graph, captured.weights), ragged)
    for row, name in enumerate(("a", "b", "c")):
        with torch.no_grad():
            expected = model(torch.tensor([tokens[name]])).logits[0, -1]
        error = float((logits[row] - expected).abs().max() / expected.abs().max())
        assert error < TOLERANCE, (kind, outtype, name, error)


@pytest.mark.parametrize("kind", FAMILIES)
def test_llama_cpps_own_gguf_of_each_family_gives_transformers_logits(
    kind: str, tmp_path: Path, tiny_hf, ragged, llama_cpp_source: Path
) -> None:
    check_family(kind, "f32", tmp_path, tiny_hf, ragged, llama_cpp_source)


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen3_moe"])
def test_the_converters_q8_0_blocks_dense_and_stacked_experts(
    kind: str, tmp_path: Path, tiny_hf, ragged, llama_cpp_source: Path
) -> None:
    check_family(kind, "q8_0", tmp_path, tiny_hf, ragged, llama_cpp_source)
