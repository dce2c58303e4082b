"""LLaVA-1.5's image encoder in plain torch.nn: a CLIP ViT up to the feature layer, then the MLP
projector into the text model's hidden size. `forward` takes one image's patches, flattened on the
host (`encoder_inputs`), and returns one row per patch (the class token's row first): the embeddings
that take the place of the image's placeholder tokens. The rows may be padded (a backend computes rows
in blocks): `num_rows` says how many are real, and attention sees only those.

The patch-embedding convolution (stride = kernel = patch) is a linear map of each flattened patch. The
class token is folded into the position table's first row and enters through a zero patch row, so the
graph needs no concatenation: row 0 of `patches` is zeros, and row 0 of `positions` is
class_embedding + position_embedding[0]; `position_ids` picks each row's (padding rows: row 0's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.frontend.ops import attention, gelu, gelu_tanh, layer_norm, quick_gelu
from kiln.ir import TensorType
from kiln.ir.vision import clip_encoder_inputs as encoder_inputs  # noqa: F401  (this family's)
from kiln.ir.vision import flat_patches  # noqa: F401  (the SigLIP families' too)

ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_layers: int  # the layers run: up to the feature layer
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    text_hidden_size: int
    projector_hidden_act: str
    keep_class_token: bool  # vision_feature_select_strategy "full" (else "default": dropped)

    @classmethod
    def from_llava(cls, config: dict[str, Any]) -> ClipVisionConfig:
        """From a LlavaForConditionalGeneration config.json."""
        vision, text = config["vision_config"], config["text_config"]
        total = int(vision["num_hidden_layers"])
        feature_layer = config.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int) or not -total - 1 <= feature_layer <= total:
            raise ModelLoadError(f"vision_feature_layer {feature_layer!r}: one layer index is supported")
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not default or full")
        for key, value in (
            ("hidden_act", vision.get("hidden_act", "quick_gelu")),
            ("projector_hidden_act", config.get("projector_hidden_act", "gelu")),
        ):
            if value not in ACTIVATIONS:
                raise ModelLoadError(f"{key} {value!r} is not one of {sorted(ACTIVATIONS)}")
        if not config.get("multimodal_projector_bias", True):
            raise ModelLoadError("a projector without biases is not supported")
        return cls(
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_attention_heads=int(vision["num_attention_heads"]),
            num_layers=feature_layer if feature_layer >= 0 else total + 1 + feature_layer,
            image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=vision.get("hidden_act", "quick_gelu"),
            text_hidden_size=int(text["hidden_size"]),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            keep_class_token=strategy == "full",
        )

    @property
    def grid(self) -> int:  # patches a side
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    @property
    def num_rows(self) -> int:  # the class token's row and one a patch
        return self.grid * self.grid + 1

    @property
    def num_image_tokens(self) -> int:  # the placeholder tokens an image takes in the prompt
        return self.num_rows if self.keep_class_token else self.num_rows - 1


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, eps=self.eps)


class LayerConfig(Protocol):
    """What a ViT encoder layer needs of its model's config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    layer_norm_eps: float
    hidden_act: str


class EncoderLayer(nn.Module):
    """A ViT layer as CLIP and SigLIP have it (pre-norm attention and MLP, biases everywhere)."""

    def __init__(self, config: LayerConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = size // self.heads
        self.layer_norm1 = LayerNorm(size, config.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(size, size) for _ in range(4))
        self.layer_norm2 = LayerNorm(size, config.layer_norm_eps)
        self.fc1 = nn.Linear(size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, size)
        self.act = config.hidden_act

    def forward(self, x: torch.Tensor, num_rows: torch.Tensor | None) -> torch.Tensor:
        h = self.layer_norm1(x)
        q, k, v = (linear(proj, h).view(-1, self.heads, self.head_dim) for proj in self.qkv)
        attended = attention(q, k, v, num_rows, scale=float(self.head_dim) ** -0.5)
        x = x + linear(self.out_proj, attended.view(-1, self.heads * self.head_dim))
        return x + linear(self.fc2, activation(self.act, linear(self.fc1, self.layer_norm2(x))))

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj


class ClipVisionProjector(nn.Module):
    def __init__(self, config: ClipVisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(config.patch_dim, config.hidden_size, bias=False)
        self.positions = nn.Parameter(torch.zeros(config.num_rows, config.hidden_size))
        self.pre_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.linear_1 = nn.Linear(config.hidden_size, config.text_hidden_size)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size)
        self.act = config.projector_hidden_act

    def forward(
        self, patches: torch.Tensor, position_ids: torch.Tensor, num_rows: torch.Tensor
    ) -> torch.Tensor:
        x = linear(self.patch_embedding, patches) + F.embedding(position_ids, self.positions)
        x = self.pre_layernorm(x)
        for layer in self.layers:
            x = layer(x, num_rows)
        return linear(self.linear_2, activation(self.act, linear(self.linear_1, x)))


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """By name at trace time: the op functions are called by their global names, which fx keeps whole."""
    if name == "quick_gelu":
        return quick_gelu(x)
    return gelu_tanh(x) if name == "gelu_pytorch_tanh" else gelu(x)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """As F.linear, which capture maps to the IR's linear (an nn.Linear call is a leaf fx cannot see into)."""
    return F.linear(x, layer.weight, layer.bias)


def encoder_layer_weights(tower: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s part of the state dict from the tower's HF tensors (`encoder.layers.N...`)."""
    state = {}
    prefix = f"encoder.layers.{index}."
    parts = ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", *(f"self_attn.{p}_proj" for p in "qkv"))
    for part in (*parts, "self_attn.out_proj"):
        ours = f"layers.{index}.{part.removeprefix('mlp.').removeprefix('self_attn.')}"
        for kind in ("weight", "bias"):
            state[f"{ours}.{kind}"] = tower[f"{prefix}{part}.{kind}"]
    return state


def tower_tensors(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the vision tower's tensors, the projector's) by their names inside each, under any of the
    prefixes transformers versions have saved them with."""
    tower, projector = {}, {}
    for name, tensor in weights.items():
        short = name.removeprefix("model.")
        if short.startswith("vision_tower."):
            tower[short.removeprefix("vision_tower.").removeprefix("vision_model.")] = tensor
        elif short.startswith("multi_modal_projector."):
            projector[short.removeprefix("multi_modal_projector.")] = tensor
    return tower, projector


def from_llava_weights(config: ClipVisionConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's state dict from a LLaVA checkpoint's tensors, under any of the prefixes
    transformers versions have saved them with."""
    tower, projector = tower_tensors(weights)
    try:
        patch = tower["embeddings.patch_embedding.weight"]
        state = {
            "patch_embedding.weight": patch.reshape(patch.shape[0], -1),
            "positions": tower["embeddings.position_embedding.weight"].clone(),
            "pre_layernorm.weight": tower["pre_layrnorm.weight"],
            "pre_layernorm.bias": tower["pre_layrnorm.bias"],
        }
        state["positions"][0] += tower["embeddings.class_embedding"]
        for i in range(config.num_layers):
            state |= encoder_layer_weights(tower, i)
        for part in ("linear_1", "linear_2"):
            for kind in ("weight", "bias"):
                state[f"{part}.{kind}"] = projector[f"{part}.{kind}"]
    except KeyError as missing:
        raise ModelLoadError(f"the LLaVA checkpoint lacks {missing.args[0]}") from None
    return state


def input_types(config: ClipVisionConfig) -> dict[str, TensorType]:
    """`forward`'s inputs: T rows (padded), as capture types them."""
    return {
        "patches": TensorType("f32", ("T", config.patch_dim)),
        "position_ids": TensorType("i64", ("T",)),
        "num_rows": TensorType("i64", (1,)),
    }
