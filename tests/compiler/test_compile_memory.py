"""A compile holds one tensor at a time, never the model: a Llama-shaped GGUF whose float32 weights
are 3.9 GB compiles in a fraction of that (the process's resident high-water mark, which counts the
pages of the GGUF and of the artifact it touched). Before weights were deferred (ir/deferred.py) the
compile dequantized every weight to float32 first: more than the float size."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 2048, 16, 4, 8192, 16
HEAD_DIM = HIDDEN // HEADS
PEAK_FRACTION = 0.6  # of the float32 weights' bytes


def _matrices(vocab: int) -> dict[str, tuple[int, int]]:
    shapes = {"token_embd.weight": (vocab, HIDDEN)}
    for layer in range(LAYERS):
        shapes |= {
            f"blk.{layer}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{layer}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{layer}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{layer}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{layer}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{layer}.ffn_down.weight": (HIDDEN, FFN),
        }
    return shapes


def _write_model(path: Path, vocab: dict[str, Any], random_blocks: Any) -> int:
    """A random-weight Q4_K GGUF of the shapes above with `vocab`'s tokenizer; its float32 bytes."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("wide test model")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in vocab.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    values = 0
    for index, (name, (rows, k)) in enumerate(_matrices(len(vocab["tokenizer.ggml.tokens"])).items()):
        writer.add_tensor(
            name,
            random_blocks("Q4_K", rows, k, seed=index, edges=False),
            raw_dtype=gguf.GGMLQuantizationType.Q4_K,
        )
        values += rows * k
    norms = ["output_norm.weight"] + [
        f"blk.{i}.{part}_norm.weight" for i in range(LAYERS) for part in ("attn", "ffn")
    ]
    for name in norms:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))
        values += HIDDEN
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 4 * values


@pytest.mark.slow
def test_a_compile_holds_a_fraction_of_the_models_float_size(
    tmp_path: Path, sentencepiece_model: Any, gguf_writers: Any, random_gguf_blocks: Any
) -> None:
    model = tmp_path / "wide.gguf"
    float_bytes = _write_model(
        model, gguf_writers.sentencepiece_vocab(sentencepiece_model), random_gguf_blocks
    )
    assert float_bytes > 3.5e9
    command = [sys.executable, "-m", "kiln.cli", "compile", str(model), "-o", str(tmp_path / "out"), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr
    peak = json.loads(result.stdout)["peak_rss_bytes"]  # the compile's own VmHWM, not this worker's
    assert peak < PEAK_FRACTION * float_bytes, (
        f"compile peaked at {peak:,} bytes for {float_bytes:,} of float32"
    )
