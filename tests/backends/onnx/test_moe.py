"""moe and quantized_moe lowered to ONNX and run on ONNX Runtime's CPU EP against the ops' reference on
one random step (T=5, E=4, top 2): standard ONNX only (the TensorRT parser's subset), the experts
gathered by the router's choice, quantized experts dequantized once at load whatever their layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.backends.onnx import LoweringOptions, check_model, lower_program, materialize
from kiln.ir import GraphBuilder, Program, TensorType, Value
from kiln.ir.ops.moe import moe, quantized_moe
from kiln.ir.ops.quant import pack_int4, unpack_int4
from kiln.ir.program import weight_type
from kiln.passes.quantize.quantizers import QuantizedWeight, quantize_int4, quantize_int8

T, HIDDEN, INNER, EXPERTS, TOP_K = 5, 64, 96, 4, 2
TOLERANCE = 1e-5  # max |ours - reference| / max |reference|: float32 sums in another order
SHAPES = {"gate": (EXPERTS, INNER, HIDDEN), "up": (EXPERTS, INNER, HIDDEN), "down": (EXPERTS, HIDDEN, INNER)}
# projection → layout: int4 (float zero points), int8 (symmetric), GGUF Q4_1 (scale * q + min, "gguf"
# nibble order, f16 scales and mins), and a mix as in GGUF Q4_K_M files (down differs, no zeros in
# gate and up).
LAYOUTS = {
    "int4": dict.fromkeys(SHAPES, "int4"),
    "int8": dict.fromkeys(SHAPES, "int8"),
    "q4_1": dict.fromkeys(SHAPES, "q4_1"),
    "mixed": {"gate": "int8", "up": "int8", "down": "q4_1"},
}


def _step(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(inputs x, router_logits; float expert weights) with a clear top 2 for each token."""
    generator = torch.Generator().manual_seed(seed)
    inputs = {
        "x": torch.randn(T, HIDDEN, generator=generator),
        "router_logits": torch.randn(T, EXPERTS, generator=generator) * 2,
    }
    experts = {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in SHAPES.items()}
    return inputs, experts


def _run(program: Program, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, str]]:
    """Lowered with standard ONNX only, checked, run on ONNX Runtime's CPU EP; (output, kernels)."""
    lowered = lower_program(program, LoweringOptions(contrib_ops=False))
    check_model(lowered.model)
    assert {o.domain for o in lowered.model.opset_import} == {""}
    session = ort.InferenceSession(lowered.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
    feeds |= {b.name: materialize(b, program.weights).numpy() for b in lowered.bindings}
    (out,) = session.run(lowered.outputs, feeds)
    return torch.from_numpy(np.asarray(out)), lowered.kernels


def _graph_inputs(builder: GraphBuilder) -> list[Value]:
    return [
        builder.input("x", TensorType("f32", ("T", HIDDEN))),
        builder.input("router_logits", TensorType("f32", ("T", EXPERTS))),
    ]


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_matches_the_reference(normalize: bool) -> None:
    inputs, experts = _step(0)
    builder = GraphBuilder("moe")
    params = [builder.param(f"experts.{name}", TensorType("f32", shape)) for name, shape in SHAPES.items()]
    attrs = {"top_k": TOP_K, "normalize": normalize}
    out = builder.op1("moe", [*_graph_inputs(builder), *params], attrs=attrs)
    program = Program(builder.build([out]), {f"experts.{name}": w for name, w in experts.items()})
    program.verify()

    ours, kernels = _run(program, inputs)
    expected = moe(inputs["x"], inputs["router_logits"], *experts.values(), **attrs)
    assert ours.shape == (T, HIDDEN)
    assert _relative_error(ours, expected) < TOLERANCE
    assert "Gather (selected experts)" in kernels["moe"]


def _quantize(experts: torch.Tensor, layout: str) -> QuantizedWeight:
    """Each expert's [N, K] quantized on its own, the results stacked [E, N, ...]."""
    each = [quantize_int8(w) if layout == "int8" else quantize_int4(w, 32) for w in experts]
    qweight, scales = (torch.stack([getattr(q, f) for q in each]) for f in ("qweight", "scales"))
    zeros = None if each[0].zeros is None else torch.stack([q.zeros for q in each])  # type: ignore[misc]
    stacked = dataclasses.replace(each[0], qweight=qweight, scales=scales, zeros=zeros)
    if layout != "q4_1":
        return stacked
    assert zeros is not None
    rows = unpack_int4(qweight.reshape(-1, qweight.shape[-1]), "pairs")
    return dataclasses.replace(
        stacked,
        qweight=pack_int4(rows, "gguf").reshape(qweight.shape),
        scales=scales.to(torch.float16),
        zeros=(-zeros * scales).to(torch.float16),
        scheme="min",
        packing="gguf",
    )


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("layouts", sorted(LAYOUTS))
def test_quantized_moe_matches_the_reference(layouts: str, normalize: bool) -> None:
    inputs, experts = _step(1)
    quantized = {name: _quantize(experts[name], LAYOUTS[layouts][name]) for name in SHAPES}
    weights: dict[str, torch.Tensor] = {}
    builder = GraphBuilder("quantized_moe")

    def param(name: str, tensor: torch.Tensor | None) -> Value | None:
        if tensor is None:
            return None
        weights[name] = tensor
        return builder.param(name, weight_type(tensor))

    operands = [
        param(f"experts.{name}.{field}", getattr(quantized[name], field))
        for field in ("qweight", "scales", "zeros")
        for name in SHAPES
    ]
    attrs: dict[str, object] = {"top_k": TOP_K, "normalize": normalize}
    attrs |= {name: q.attrs() for name, q in quantized.items()}
    while operands[-1] is None:
        operands.pop()
    out = builder.op1("quantized_moe", [*_graph_inputs(builder), *operands], attrs=attrs)
    program = Program(builder.build([out]), weights)
    program.verify()

    ours, kernels = _run(program, inputs)
    tensors = [weights.get(v.name) if v is not None else None for v in operands]
    expected = quantized_moe(inputs["x"], inputs["router_logits"], *tensors, **attrs)
    assert _relative_error(ours, expected) < TOLERANCE
    assert kernels["quantized_moe"].endswith("(experts dequantized at load)")
    # each projection's experts bound as one float [E, N, K]; the packed ones never reach the model
    lowered = lower_program(program, LoweringOptions(contrib_ops=False))
    assert sorted((b.kind, tuple(b.shape)) for b in lowered.bindings) == sorted(
        ("dequantized", shape) for shape in SHAPES.values()
    )
