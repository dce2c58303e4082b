"""The ONNX lowering: SmolLM2 (O2, float32 and GGUF Q4_1) passes the full checker and strict shape
inference; an op without a rule is refused naming the op and its model line; the MatMulNBits
repacking of every layout stands for the same weight as the reference's dequantization."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.base import BackendError
from kiln.backends.onnx import LoweringOptions, WeightBinding, check_model, lower_program, materialize
from kiln.backends.onnx.rules import RULES
from kiln.backends.onnx.weights import integral_zero_points
from kiln.ir import GraphBuilder, Program, TensorType
from kiln.ir.ops.quant import dequantize, pack_int4, unpack_int4
from kiln.passes.quantize.quantizers import quantize_int4, quantize_int8


def test_smollm2_lowers_and_passes_the_full_checker(smollm2_o2) -> None:
    lowered = lower_program(smollm2_o2.program)
    lines = check_model(lowered.model)
    assert "check_model(full_check=True) passes" in lines[0]
    assert "shape inference passes" in lines[1]
    assert lowered.kv_layers == list(range(30))
    assert not lowered.model.graph.initializer or all(
        t.name.startswith("_const") for t in lowered.model.graph.initializer
    )  # weights are graph inputs, bound at load: the file holds only small constants
    assert lowered.model.ByteSize() < 1_000_000


def test_standard_onnx_only_for_tensorrt(smollm2_o2) -> None:
    lowered = lower_program(smollm2_o2.program, LoweringOptions(contrib_ops=False))
    assert {o.domain for o in lowered.model.opset_import} == {""}
    check_model(lowered.model)


def test_an_op_without_a_rule_names_the_op_and_the_model_line(smollm2_o2) -> None:
    rules = {op: rule for op, rule in RULES.items() if op != "swiglu"}
    with pytest.raises(BackendError) as caught:
        lower_program(smollm2_o2.program, rules=rules)
    message = str(caught.value)
    assert "(op swiglu)" in message and "no lowering rule" in message
    assert "frontend/models/llama.py:" in message  # where the model wrote it
    assert caught.value.hint is not None


def test_a_capability_check_refusal_names_the_node() -> None:
    builder = GraphBuilder("bf16_quant")
    x = builder.input("x", TensorType("bf16", ("T", 64)))
    q = builder.param("w.qweight", TensorType("u8", (8, 32)))
    s = builder.param("w.scales", TensorType("bf16", (8, 2)))
    z = builder.param("w.zeros", TensorType("bf16", (8, 2)))
    attrs = {"bits": 4, "group_size": 32, "scheme": "zero_point", "packing": "pairs"}
    out = builder.op1("quantized_linear", [x, q, s, z], attrs=attrs, source="model.py:7 y = proj(x)")
    graph = builder.build([out])
    weights = {
        "w.qweight": torch.zeros(8, 32, dtype=torch.uint8),
        "w.scales": torch.ones(8, 2, dtype=torch.bfloat16),
        "w.zeros": torch.ones(8, 2, dtype=torch.bfloat16),
    }
    with pytest.raises(BackendError, match=r"\(op quantized_linear\) at model.py:7 y = proj\(x\).*float32"):
        lower_program(Program(graph, weights))


def _nbits_weight(qweight, scales, zeros, layout: dict, n: int, k: int, block: int) -> torch.Tensor:
    """The weight the bound operands stand for: scale * (q - zero_point) (+ the group's min)."""
    bits, group = layout["bits"], layout["group_size"]
    integral = integral_zero_points(layout["scheme"], bits, zeros)
    attrs = {**layout, "block_size": block, "k": k, "integral": integral}
    sources = {"q": qweight, "s": scales, **({"z": zeros} if zeros is not None else {})}
    names = list(sources)
    blocks = k // block

    def bound(kind: str, dtype: str, shape: list[int]) -> torch.Tensor:
        return materialize(WeightBinding(kind, kind, names, dtype, shape, attrs), sources)

    q = bound("nbits_qweight", "u8", [n, blocks, block * bits // 8])
    s = bound("nbits_scales", "f32", [n * blocks]).reshape(n, blocks, 1)
    zero_bytes = bound("nbits_zeros", "u8", [n * -(-blocks * bits // 8)]).reshape(n, -1)
    zp = unpack_int4(zero_bytes, "pairs")[:, :blocks] if bits == 4 else zero_bytes
    values = unpack_int4(q.reshape(n, -1), "pairs") if bits == 4 else q.reshape(n, k)
    weight = s * (values.reshape(n, blocks, block).to(torch.float32) - zp.reshape(n, blocks, 1).float())
    weight = weight.reshape(n, k)
    if not integral:
        mins = bound("nbits_mins", "f32", [n, k // group])
        weight = weight + mins.repeat_interleave(group, dim=1)
    return weight


@pytest.mark.parametrize("layout_name", ["int4", "int8", "q4_0", "q4_1"])
def test_matmulnbits_repacking_stands_for_the_reference_weight(layout_name: str) -> None:
    torch.manual_seed(0)
    n, k = 16, 96  # 96: groups of 32 (int4, Q4_1), one group of 96 per row split in 3 blocks (int8)
    weight = torch.randn(n, k)
    if layout_name == "int8":
        quantized = quantize_int8(weight)
        qweight, scales, zeros = quantized.qweight, quantized.scales.reshape(n, 1), None
    else:
        quantized = quantize_int4(weight, 32)
        qweight, scales, zeros = quantized.qweight, quantized.scales, quantized.zeros
    layout = quantized.attrs()
    if layout_name == "q4_0":  # GGUF: f16 scale, zero point 8, "gguf" nibble order
        qweight = pack_int4(unpack_int4(qweight, "pairs"), "gguf")
        zeros = torch.full_like(scales, 8.0, dtype=torch.float16)
        scales = scales.to(torch.float16)
        layout = {**layout, "packing": "gguf"}
    if layout_name == "q4_1":  # GGUF: f16 scale and min, scale * q + min, "gguf" nibble order
        qweight = pack_int4(unpack_int4(qweight, "pairs"), "gguf")
        zeros = (-zeros * scales).to(torch.float16)
        scales = scales.to(torch.float16)
        layout = {**layout, "scheme": "min", "packing": "gguf"}
    expected = dequantize(qweight, scales, zeros, **layout)
    ours = _nbits_weight(qweight, scales, zeros, layout, n, k, 32)
    error = float((ours - expected).abs().max() / expected.abs().max())
    # exact where the zero point is a level; int4's float zero point z becomes min = -scale * z (rounds)
    assert error < (1e-6 if layout_name == "int4" else 1e-7)


def test_a_float8_kv_cache_is_refused_naming_the_backend_that_runs_it(tmp_path, make_tiny_program) -> None:
    from kiln.passes import PassManager, PassOptions, pipeline

    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    options = PassOptions(kv_cache_dtype="fp8_e4m3")
    fp8 = PassManager(pipeline(2, options)).run(program, options)[0]
    with pytest.raises(BackendError, match=r"\(op paged_attention\).*float8 KV cache .* TVM backend only"):
        lower_program(fp8)
