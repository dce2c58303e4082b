"""Write a random-weight Qwen3-MoE GGUF for benchmarks: SmolLM2's tokenizer (copied from its GGUF),
16 experts of which each token uses 2, experts Q4_1 and the rest Q8_0, as llama.cpp loads it.

    .venv/bin/python scripts/make_moe_gguf.py OUT.gguf [--tokenizer-from smollm2-135m-instruct]

The weights are random (the text is noise); what it is for is speed and bytes read per token beside
llama.cpp on the same file (bench/compare.py --model OUT.gguf).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

ARCH = "qwen3moe"
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 512, 8, 4, 64
EXPERTS, EXPERTS_USED, EXPERT_FFN = 16, 2, 768
Q = gguf.GGMLQuantizationType


def _copy_tokenizer(source: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copy every tokenizer.* key; returns the vocabulary size."""
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            item_type = field.types[-1]
            if item_type == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i][0].item() for i in field.data]
            writer.add_array(key, values)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(key, field.parts[field.data[0]][0].item(), value_type)
    return len(source.fields["tokenizer.ggml.tokens"].data)


def write(out: Path, tokenizer_gguf: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, ARCH)
    vocab = _copy_tokenizer(gguf.GGUFReader(tokenizer_gguf), writer)
    writer.add_name("random qwen3moe 16x2 (benchmark)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(EXPERT_FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_expert_feed_forward_length(EXPERT_FFN)

    def matrix(name: str, shape: tuple[int, ...], kind: Q, scale: float) -> None:
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", (vocab, HIDDEN), Q.Q8_0, 0.05)
    vector("output_norm.weight", HIDDEN)
    for layer in range(LAYERS):
        blk = f"blk.{layer}."
        vector(blk + "attn_norm.weight", HIDDEN)
        vector(blk + "ffn_norm.weight", HIDDEN)
        vector(blk + "attn_q_norm.weight", HEAD_DIM)
        vector(blk + "attn_k_norm.weight", HEAD_DIM)
        matrix(blk + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q8_0, HIDDEN**-0.5)
        matrix(blk + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0, HIDDEN**-0.5)
        matrix(blk + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0, HIDDEN**-0.5)
        matrix(blk + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q8_0, HIDDEN**-0.5)
        writer.add_tensor(  # the router stays float32, as llama.cpp's quantizer leaves it
            blk + "ffn_gate_inp.weight", (rng.standard_normal((EXPERTS, HIDDEN)) * 0.05).astype(np.float32)
        )
        matrix(blk + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), Q.Q4_1, HIDDEN**-0.5)
        matrix(blk + "ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), Q.Q4_1, HIDDEN**-0.5)
        matrix(blk + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), Q.Q4_1, EXPERT_FFN**-0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer-from", default="smollm2-135m-instruct", help="a GGUF or model name")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; name a new file (this script does not overwrite files)")
    from kiln.frontend.pull import resolve_model

    write(args.out, resolve_model(args.tokenizer_from))
    print(args.out)


if __name__ == "__main__":
    main()
