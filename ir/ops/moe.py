"""The mixture-of-experts block as one op: routing, the selected experts' SwiGLU FFNs, the weighted sum.

    probs            = softmax(router_logits[t], float32)          over the E experts
    weights, experts = top_k(probs)                                 (renormalised to sum 1 if `normalize`)
    out[t]           = sum_j weights[j] * down[e_j] @ (silu(gate[e_j] @ x[t]) * up[e_j] @ x[t])

The router's linear stays outside (a plain `linear` whose output is `router_logits`), so backends
lower it like any other. Expert weights are stacked: gate and up [E, I, H], down [E, H, I]. A backend
should read only the selected experts' weights: at decode, top_k / E of the experts' bytes.

`quantized_moe` is the same block over quantized experts; each projection has its own layout (a
GGUF Q4_K_M file mixes Q4_K gate/up with Q6_K down), given as the attributes `quantized_linear`
takes (quant.py), applied to each expert's [N, K] slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ir.ops.basic import linear_rows
from kiln.ir.ops.quant import PACKINGS, SCHEMES, dequantize
from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import FLOAT_DTYPES, TensorType

PROJECTIONS = ("gate", "up", "down")
MOE_ATTRS = {
    "top_k": "experts a token uses",
    "normalize": "renormalise the top-k probabilities to sum 1 (Mixtral, Qwen3-MoE) or not (OLMoE)",
}
LAYOUT_KEYS = ("bits", "group_size", "scheme", "packing", "value_bits", "scale_block")


def route(router_logits: torch.Tensor, *, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]), as HF's top-k routers compute them."""
    probs = F.softmax(router_logits.to(torch.float32), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _check_routing(x: TensorType, logits: TensorType, experts: int, attrs: dict[str, Any]) -> None:
    require(x.dtype in FLOAT_DTYPES and x.rank == 2, f"x must be float [T, hidden], got {x.text()}")
    require(
        logits.rank == 2 and logits.shape == (x.shape[0], experts),
        f"router_logits {logits.text()} must be [{x.shape[0]}, {experts}]",
    )
    top_k = attrs.get("top_k")
    require(isinstance(top_k, int) and 1 <= top_k <= experts, f"top_k {top_k!r} must be 1..{experts} experts")
    require(isinstance(attrs.get("normalize"), bool), "normalize must be true or false")


def _infer_moe(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, logits = required(inputs[0], "x"), required(inputs[1], "router_logits")
    gate, up, down = (required(inputs[2 + i], f"{part} weights") for i, part in enumerate(PROJECTIONS))
    require(gate.rank == 3, f"gate weights must be [experts, inner, hidden], got {gate.text()}")
    experts, inner, hidden = gate.shape
    require(hidden == x.shape[1], f"gate weights {gate.text()} do not fit x {x.text()}")
    require(up.shape == gate.shape, f"up weights {up.text()} must match gate {gate.text()}")
    require(
        down.shape == (experts, hidden, inner),
        f"down weights {down.text()} must be [{experts},{hidden},{inner}]",
    )
    require(
        gate.dtype == up.dtype == down.dtype == x.dtype, f"x and expert weights differ in dtype: {x.dtype}"
    )
    assert isinstance(experts, int)
    _check_routing(x, logits, experts, attrs)
    return [TensorType(x.dtype, x.shape)]


ExpertWeight = Any  # (expert index) -> float weight [N, K]


def _moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    expert_weight: dict[str, ExpertWeight],
    *,
    top_k: int,
    normalize: bool,
) -> torch.Tensor:
    """Tokens grouped by expert; each token's results summed in expert order (batch invariant)."""
    weights, experts = route(router_logits, top_k=top_k, normalize=normalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        tokens, slots = torch.where(experts == expert)
        rows = x[tokens]
        gate = linear_rows(rows, expert_weight["gate"](expert).to(x.dtype))
        up = linear_rows(rows, expert_weight["up"](expert).to(x.dtype))
        y = linear_rows(F.silu(gate) * up, expert_weight["down"](expert).to(x.dtype))
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out


def moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    top_k: int,
    normalize: bool,
) -> torch.Tensor:
    stacked = {"gate": gate, "up": up, "down": down}
    weights = {name: (lambda e, w=w: w[e]) for name, w in stacked.items()}
    return _moe(x, router_logits, weights, top_k=top_k, normalize=normalize)


register(
    OpDef(
        "moe",
        (5, 5),
        MOE_ATTRS,
        _infer_moe,
        moe,
        doc="(x[T,H], router_logits[T,E], gate[E,I,H], up[E,I,H], down[E,H,I]) -> top-k SwiGLU experts",
    )
)


def _check_layout(name: str, layout: Any) -> dict[str, Any]:
    require(isinstance(layout, dict), f"{name} layout must be a dict of quantized_linear's attributes")
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    require(not unknown, f"{name} layout has unknown keys {unknown}")
    bits, packing, scheme, group = (layout.get(k) for k in ("bits", "packing", "scheme", "group_size"))
    require(bits in PACKINGS and packing in PACKINGS[bits], f"{name}: bits {bits} with packing {packing!r}")
    require(scheme in SCHEMES, f"{name}: scheme must be one of {SCHEMES}, got {scheme!r}")
    require(isinstance(group, int) and group > 0, f"{name}: group_size {group!r} must be a positive int")
    return layout


def quantized_inputs(inputs: Sequence[Any]) -> dict[str, tuple[Any, Any, Any]]:
    """Projection → (qweight, scales, zeros or None) from quantized_moe's inputs."""
    padded = [*inputs, None, None, None][:11]
    return {p: (padded[2 + i], padded[5 + i], padded[8 + i]) for i, p in enumerate(PROJECTIONS)}


def _infer_quantized_moe(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x, logits = required(inputs[0], "x"), required(inputs[1], "router_logits")
    parts = quantized_inputs(inputs)
    shapes: dict[str, tuple[int, int, int]] = {}
    for name, (qweight_type, scales_type, zeros_type) in parts.items():
        layout = _check_layout(name, attrs.get(name))
        qweight, scales = required(qweight_type, f"{name} qweight"), required(scales_type, f"{name} scales")
        require(qweight.rank == 3, f"{name} qweight must be [experts, N, packed K], got {qweight.text()}")
        experts, n, packed = (int(d) for d in qweight.shape)
        k = packed * 2 if layout["bits"] == 4 else packed
        require(
            qweight.dtype == ("u8" if layout["bits"] == 4 else "i8"), f"{name} qweight dtype {qweight.dtype}"
        )
        require(k % layout["group_size"] == 0, f"{name}: K {k} is not a multiple of {layout['group_size']}")
        require(
            scales.shape == (experts, n, k // layout["group_size"]) and scales.dtype in FLOAT_DTYPES,
            f"{name} scales {scales.text()} must be float [{experts},{n},{k // layout['group_size']}]",
        )
        require(
            (zeros_type is None) == (layout["scheme"] == "symmetric"),
            f"{name}: scheme {layout['scheme']} {'takes no' if zeros_type else 'needs'} zeros",
        )
        if zeros_type is not None:
            require(zeros_type.shape == scales.shape, f"{name} zeros {zeros_type.text()} must match scales")
        shapes[name] = (experts, n, k)
    experts, inner, hidden = shapes["gate"]
    require(hidden == x.shape[1], f"gate experts [{experts},{inner},{hidden}] do not fit x {x.text()}")
    require(shapes["up"] == shapes["gate"], f"up experts {shapes['up']} must match gate {shapes['gate']}")
    require(shapes["down"] == (experts, hidden, inner), f"down experts {shapes['down']} do not fit gate")
    _check_routing(x, logits, experts, attrs)
    return [TensorType(x.dtype, x.shape)]


def quantized_moe(
    x: torch.Tensor, router_logits: torch.Tensor, *weights: torch.Tensor | None, **attrs: Any
) -> torch.Tensor:
    parts = quantized_inputs((x, router_logits, *weights))

    def expert_weight(name: str) -> ExpertWeight:
        qweight, scales, zeros = parts[name]
        layout = {k: v for k, v in attrs[name].items() if k in ("bits", "group_size", "scheme", "packing")}
        return lambda e: dequantize(qweight[e], scales[e], None if zeros is None else zeros[e], **layout)

    weights = {name: expert_weight(name) for name in PROJECTIONS}
    return _moe(x, router_logits, weights, top_k=attrs["top_k"], normalize=attrs["normalize"])


register(
    OpDef(
        "quantized_moe",
        (8, 11),
        MOE_ATTRS | {p: f"the {p} experts' layout: quantized_linear's attributes" for p in PROJECTIONS},
        _infer_quantized_moe,
        quantized_moe,
        doc="moe over quantized experts: (x, router_logits, gate_q, up_q, down_q, gate_s, up_s, down_s, "
        "gate_z?, up_z?, down_z?)",
    )
)
