"""The `lora` op lowered alone: it passes the full checker and strict shape inference, and run by ONNX
Runtime matches the op's torch reference for a fused op of two pieces over rows of slots 0..S-1 and -1
(those exactly y), for empty tables (LS = 0, LR = 0) and for no rows; TensorRT refuses enable_lora."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kiln.backends.onnx import check_model, lower_program
from kiln.ir import GraphBuilder, Program, TensorType
from kiln.ir.ops.lora import lora

K, SIZES, LAYERS, LAYER = 24, [16, 8], 3, 1


def _session() -> tuple[ort.InferenceSession, str]:
    builder = GraphBuilder("lora")
    y = builder.input("y", TensorType("f32", ("T", sum(SIZES))))
    x = builder.input("x", TensorType("f32", ("T", K)))
    slots = builder.input("slots", TensorType("i64", ("T",)))
    tables = []
    for piece, size in enumerate(SIZES):
        tables.append(builder.input(f"a{piece}", TensorType("f32", (LAYERS, "LS", "LR", K))))
        tables.append(builder.input(f"b{piece}", TensorType("f32", (LAYERS, "LS", "LR", size))))
    out = builder.op1("lora", [y, x, slots, *tables], attrs={"layer": LAYER, "sizes": SIZES})
    lowered = lower_program(Program(builder.build([out]), {}))
    check_model(lowered.model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        lowered.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session, lowered.outputs[0]


def _inputs(rows: int, slots: list[int], num_slots: int, rank: int) -> dict[str, np.ndarray]:
    generator = np.random.default_rng(0)
    given = {
        "y": generator.standard_normal((rows, sum(SIZES))).astype(np.float32),
        "x": generator.standard_normal((rows, K)).astype(np.float32),
        "slots": np.array(slots, np.int64),
    }
    for piece, size in enumerate(SIZES):
        given[f"a{piece}"] = generator.standard_normal((LAYERS, num_slots, rank, K)).astype(np.float32)
        given[f"b{piece}"] = generator.standard_normal((LAYERS, num_slots, rank, size)).astype(np.float32)
    return given


def _reference(given: dict[str, np.ndarray]) -> np.ndarray:
    if given["a0"].shape[2] == 0:  # rank 0 adds nothing (linear_rows cannot take a [rows, 0] input)
        return given["y"]
    tensors = [torch.from_numpy(given[name]) for name in ("y", "x", "slots", "a0", "b0", "a1", "b1")]
    return lora(*tensors, layer=LAYER, sizes=SIZES).numpy()


@pytest.mark.parametrize(
    ("slots", "num_slots", "rank"),
    [([2, -1, 0, 1, 0, -1, 2], 3, 4), ([-1, -1], 0, 0), ([-1, 0], 2, 0), ([], 3, 4), ([-1, 1], 2, 1)],
)
def test_lora_matches_the_torch_reference(slots: list[int], num_slots: int, rank: int) -> None:
    session, output = _session()
    given = _inputs(len(slots), slots, num_slots, rank)
    (got,) = session.run([output], given)
    expected = _reference(given)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    base = np.array(slots, np.int64) < 0
    assert np.array_equal(got[base], given["y"][base])  # slot -1: exactly y
    if rank and not base.all():
        assert not np.allclose(got[~base], given["y"][~base])


def test_tensorrt_refuses_lora_naming_the_option() -> None:
    from kiln.backends.base import BuildRequest
    from kiln.backends.registry import get_backend
    from kiln.backends.targets import Target
    from kiln.compiler.options import ModelOptions, OptionsError
    from kiln.compiler.plan import resolve

    with pytest.raises(OptionsError, match=r"LoRA adapters run on .* not tensorrt") as caught:
        resolve(
            ModelOptions(
                "m.gguf", backend="tensorrt", target="cuda:sm_90", quantization="none", enable_lora=True
            )
        )
    assert caught.value.hint is not None and "--enable-lora" in caught.value.hint
    request = BuildRequest(
        quantization=None,
        dtype="f32",
        kv_cache_dtype=None,
        activation_bits=16,
        tensor_parallel_size=1,
        enable_lora=True,
    )
    refusal = get_backend("tensorrt").capabilities(Target.parse("cuda:sm_90")).refusal(request)
    assert refusal is not None and refusal.option == "enable_lora"
    assert get_backend("onnxruntime").capabilities(Target("cpu")).refusal(request) is None
