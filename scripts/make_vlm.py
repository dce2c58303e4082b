"""A vision-language model with random weights, saved by transformers as a HF directory and converted by
llama.cpp's own convert_hf_to_gguf.py into the text GGUF and the `--mmproj` image-encoder GGUF that
llama-server runs.

    python scripts/make_vlm.py OUT [--family smolvlm|gemma3] [--shape tiny|256m] [--outtype f32|f16]

OUT/hf (the checkpoint), OUT/text.gguf, OUT/mmproj.gguf. The tokenizer is byte-level BPE (llama.cpp's
converter reads it; a newline and two newlines are tokens, as llama.cpp's Idefics3 prompt looks them up)
with the family's special tokens.

SmolVLM (Idefics3ForConditionalGeneration): "tiny": SigLIP 32 x 32 tiles of 4 x 4 patches, a 2-layer
Llama of width 64 (tests); "256m": SmolVLM-256M's shapes (SigLIP-base at 512 x 512, patch 16, 12 layers;
pixel shuffle by 4: 64 tokens a tile; a 30-layer Llama of width 576) for benchmarks.
Gemma 3 (Gemma3ForConditionalGeneration), "tiny" only: SigLIP 32 x 32 in 4 x 4 patches pooled to 16
tokens, a 2-layer Gemma 3 of width 64 (sliding layers of window 32, as llama.cpp reads its file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SPECIAL = [
    "<|endoftext|>",
    "<fake_token_around_image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
    "<end_of_utterance>",
    "<image>",
]
CHAT_TEMPLATE = (  # SmolVLM's shape: "User:<image>text<end_of_utterance>\nAssistant:"
    "{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
        },
        "image_size": 32,
        "patch_size": 4,
        "scale_factor": 2,
        "longest_edge": 64,
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
        },
    },
    "256m": {
        "vision": {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
        },
        "image_size": 512,
        "patch_size": 16,
        "scale_factor": 4,
        "longest_edge": 512,
        "text": {
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "num_hidden_layers": 30,
        },
    },
}


def save_tokenizer(
    folder: Path, special: list[str] = SPECIAL, end: str = "<end_of_utterance>", template: str = CHAT_TEMPLATE
) -> dict[str, int]:
    """The byte-level BPE tokenizer with the `special` tokens (the first also its bos and unk), `end` its
    eos; returns its vocabulary."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from kiln.frontend.gguf_tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    newline = alphabet[10]
    merges = [(newline, newline), *[(a, b) for a in "abcdefgh" for b in "abcdefgh"][:40]]
    vocab = {alphabet[byte]: byte for byte in range(256)}
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=special[0], eos_token=end, unk_token=special[0]
    )
    hf.chat_template = template
    hf.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # the converter's BPE path
    config_file.write_text(json.dumps(config))
    return tokenizer.get_vocab()


def save_smolvlm(folder: Path, shape: str = "tiny") -> Any:
    """The checkpoint at `folder` (norms and biases random too, so that a wrong mapping shows); returns
    the model."""
    import torch
    import transformers

    sizes = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(folder)
    image_id, end_id = vocab["<image>"], vocab["<end_of_utterance>"]
    vision = transformers.Idefics3VisionConfig(
        **sizes["vision"], image_size=sizes["image_size"], patch_size=sizes["patch_size"]
    )
    text = transformers.LlamaConfig(
        **sizes["text"],
        architectures=["VLlama3ForCausalLM"],  # as SmolVLM's text config says: the converter's text route
        vocab_size=len(vocab),
        eos_token_id=end_id,
        bos_token_id=0,
        tie_word_embeddings=False,
    )
    config = transformers.Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=sizes["scale_factor"],
        image_token_id=image_id,
        eos_token_id=end_id,
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.normal_(0, 0.5)
            if shape != "tiny":
                continue
            if name.endswith("patch_embedding.weight"):  # the pixels outweigh the random bias: each
                parameter.normal_(0, 0.3)  # image leads the tiny model to tokens of its own
            if name == "lm_head.weight":  # logits far apart: greedy tokens no near-tie that rounding flips
                parameter.normal_(0, 1.0)
    model.save_pretrained(folder)
    transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": sizes["longest_edge"]},
        max_image_size={"longest_edge": sizes["image_size"]},
        do_image_splitting=True,
    ).save_pretrained(folder)
    return model


GEMMA3_SPECIAL = [
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
GEMMA3_TEMPLATE = (  # Gemma 3's shape: an image part is its start token
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>{% else %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TOKENS = 16  # an image's


def save_gemma3(folder: Path, shape: str = "tiny") -> Any:
    """A tiny Gemma 3 with images at `folder` (norms and the projection random too); returns the model."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    if shape != "tiny":
        raise SystemExit("gemma3: only the tiny shape is made")
    folder.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(folder, GEMMA3_SPECIAL, "<end_of_turn>", GEMMA3_TEMPLATE)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        image_size=32,
        patch_size=4,
        vision_use_head=False,
    )
    text = transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        head_dim=16,
        vocab_size=len(vocab),
        sliding_window=32,  # llama.cpp makes both layers sliding ones (every 6th is full): the image in view
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<end_of_turn>"],
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=GEMMA3_TOKENS,
        boi_token_index=vocab["<start_of_image>"],
        eoi_token_index=vocab["<end_of_image>"],
        image_token_index=vocab["<image_soft_token>"],
        eos_token_id=vocab["<end_of_turn>"],
    )
    torch.manual_seed(1)  # seed 0's images part only where its repeated tokens end
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "projection" in name:
                parameter.normal_(0, 0.5)
            if "input_projection" in name:  # the converter stores it as float16: no rounding then
                parameter.copy_(parameter.half().float())
            if "embed_tokens" in name:  # logits far apart: greedy tokens no near-tie that rounding flips
                parameter.normal_(0, 0.06)
            if name.endswith("patch_embedding.weight"):  # the pixels outweigh the random bias
                parameter.normal_(0, 0.3)
            if "language_model" in name and name.endswith(("v_proj.weight", "o_proj.weight")):
                parameter.normal_(0, 0.3)  # what attention reads (the image) outweighs the token's embedding
    model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")  # as transformers 4 named them, as the converter reads
    older = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in weights.items()}
    save_file(older, folder / "model.safetensors", metadata={"format": "pt"})
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).to_dict()
    processor["image_seq_length"] = GEMMA3_TOKENS  # the converter's pooling factor comes from it
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return model


FAMILIES = {"smolvlm": save_smolvlm, "gemma3": save_gemma3}


def image(size: tuple[int, int], seed: int) -> Any:
    """A PIL image of `size` (width, height) in one colour drawn from `seed`: any resize keeps it, so
    llama.cpp's (without antialiasing) and Pillow's give the same pixels, and each colour leads the tiny
    models to tokens of its own (bench/vision_peers.py's images, and tests/frontend/test_vision_gguf.py's)."""
    import numpy as np
    from PIL import Image

    width, height = size
    colour = np.random.default_rng(seed).integers(0, 256, 3, dtype=np.uint8)
    return Image.fromarray(np.broadcast_to(colour, (height, width, 3)).copy())


def convert(source: Path, hf: Path, out: Path, outtype: str = "f32") -> tuple[Path, Path]:
    """llama.cpp's converter on `hf`: (text GGUF, mmproj GGUF) under `out`."""
    files = (out / "text.gguf", out / "mmproj.gguf")
    for flags, file in (([], files[0]), (["--mmproj"], files[1])):
        command = [
            sys.executable,
            str(REPO / "scripts" / "llama_cpp_convert.py"),
            str(source),
            "gpt-2",
            str(hf),
        ]
        command += [*flags, "--outtype", outtype, "--outfile", str(file)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {hf}:\n{result.stderr[-3000:]}")
    return files


def llama_cpp_source() -> Path:
    from kiln.frontend.pull import kiln_home

    found = sorted((kiln_home() / "llama.cpp-source").glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise SystemExit("no llama.cpp source: run `bash scripts/llama_cpp_source.sh '' --python-only`")
    return found[-1].parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="smolvlm")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--outtype", choices=("f32", "f16"), default="f32")
    args = parser.parse_args()
    FAMILIES[args.family](args.out / "hf", args.shape)
    text, mmproj = convert(llama_cpp_source(), args.out / "hf", args.out, args.outtype)
    print(f"{args.out / 'hf'}\n{text}\n{mmproj}")


if __name__ == "__main__":
    main()
