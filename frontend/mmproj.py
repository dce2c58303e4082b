"""llama.cpp's image-encoder files (`mmproj-*.gguf`, written by its convert_hf_to_gguf.py --mmproj) read
back into the shapes a transformers checkpoint has: a config.json-like dict and the tower's and
projector's tensors under HF names, which the encoder definitions then load as they load a checkpoint.

    encoder = read_mmproj(Path("mmproj-model-f16.gguf"))  # kind "gemma3" or "idefics3"
    config = Gemma3VisionConfig.from_gemma3(encoder.config)
    state = from_gemma3_weights(config, encoder.tensors)

The converter stores Gemma's soft-embedding norm as 1 + w (llama.cpp's RMSNorm multiplies by the weight):
it is read back as w, as the checkpoint holds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.frontend.gguf_loader import field_value, open_gguf, reader_tensor
from kiln.ir.deferred import materialize

PROJECTORS = ("gemma3", "idefics3")
_LAYER_PARTS = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_TOWER = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
_PROJECTOR = {
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
    "mm.model.fc.weight": "connector.modality_projection.proj.weight",
}
_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class MmprojEncoder:
    kind: str  # the projector type: one of PROJECTORS
    config: dict[str, Any]  # as the family's config.json has it (vision_config, text_config, ...)
    tensors: dict[str, torch.Tensor]  # HF names: vision_tower.*, multi_modal_projector.* / connector.*
    preprocessor: dict[str, Any]  # as the family's preprocessor_config.json has it


def read_mmproj(path: Path) -> MmprojEncoder:
    where = str(path)
    reader = open_gguf(path)
    if not field_value(reader, "clip.has_vision_encoder"):
        raise ModelLoadError(f"{where}: not an image encoder (no clip.has_vision_encoder)")
    kind = field_value(reader, "clip.projector_type")
    if kind not in PROJECTORS:
        raise ModelLoadError(
            f"{where}: projector type {kind!r} is not supported", hint=f"supported: {', '.join(PROJECTORS)}"
        )
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{where}: tensor {tensor.name!r} is not one Kiln knows in a {kind} encoder")
        tensors[name] = materialize(reader_tensor(tensor, where)).to(torch.float32)
    norm = "multi_modal_projector.mm_soft_emb_norm.weight"
    if norm in tensors:
        tensors[norm] = tensors[norm] - 1.0
    config = _config(reader, kind, where)
    return MmprojEncoder(kind, config, tensors, _preprocessor(reader, kind, config["vision_config"]))


def _preprocessor(reader: Any, kind: str, vision: dict[str, Any]) -> dict[str, Any]:
    """The image processor's settings the file keeps (size, mean, std), the rest its family's defaults."""
    size = int(vision["image_size"])
    common = {
        "image_mean": list(field_value(reader, "clip.vision.image_mean") or (0.5, 0.5, 0.5)),
        "image_std": list(field_value(reader, "clip.vision.image_std") or (0.5, 0.5, 0.5)),
        "rescale_factor": 1 / 255,
    }
    if kind == "gemma3":
        return common | {
            "image_processor_type": "Gemma3ImageProcessor",
            "size": {"height": size, "width": size},
            "resample": 2,
        }
    longest = int(field_value(reader, "clip.vision.preproc_image_size") or size)
    return common | {
        "image_processor_type": "Idefics3ImageProcessor",
        "size": {"longest_edge": longest},
        "max_image_size": {"longest_edge": size},
        "do_image_splitting": True,
        "resample": 1,
    }


def _hf_name(name: str) -> str | None:
    if name in _PROJECTOR:
        return _PROJECTOR[name]
    stem, _, kind = name.rpartition(".")
    if stem in _TOWER:
        return f"vision_tower.{_TOWER[stem]}.{kind}"
    block = _BLOCK.fullmatch(name)
    if block and block.group(2) in _LAYER_PARTS:
        return f"vision_tower.encoder.layers.{block.group(1)}.{_LAYER_PARTS[block.group(2)]}.{block.group(3)}"
    return None


def _config(reader: Any, kind: str, where: str) -> dict[str, Any]:
    def need(key: str) -> Any:
        value = field_value(reader, key)
        if value is None:
            raise ModelLoadError(f"{where}: the encoder's metadata has no {key!r}")
        return value

    vision = {
        "hidden_size": need("clip.vision.embedding_length"),
        "intermediate_size": need("clip.vision.feed_forward_length"),
        "num_attention_heads": need("clip.vision.attention.head_count"),
        "num_hidden_layers": need("clip.vision.block_count"),
        "image_size": need("clip.vision.image_size"),
        "patch_size": need("clip.vision.patch_size"),
        "layer_norm_eps": need("clip.vision.attention.layer_norm_epsilon"),
        "hidden_act": "gelu_pytorch_tanh",
    }
    config: dict[str, Any] = {
        "vision_config": vision,
        "text_config": {"hidden_size": need("clip.vision.projection_dim")},
    }
    grid = vision["image_size"] // vision["patch_size"]
    scale = field_value(reader, "clip.vision.projector.scale_factor")
    if kind == "gemma3":
        config["mm_tokens_per_image"] = (grid // (scale or 4)) ** 2
    else:
        config["scale_factor"] = scale or 2
    return config
