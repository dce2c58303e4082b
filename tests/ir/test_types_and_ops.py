"""Types parse and print; op shape rules, including symbolic reshape."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import QuantLayout, TensorType
from kiln.ir.ops import REGISTRY, ShapeError
from kiln.ir.ops.basic import resolve_reshape


@pytest.mark.parametrize(
    "text", ["f32[T,576]", "i64[B1]", "bf16[]", "f32[2,2,NB,BS,3,64]", "f32[64,576]{q4/g32/min/gguf_q4_1}"]
)
def test_type_text_round_trips(text: str) -> None:
    assert TensorType.parse(text).text() == text


def test_bad_types_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        TensorType("f31", (1,))
    with pytest.raises(ValueError, match="quant scheme"):
        QuantLayout(4, 32, "asymmetric", "x")
    with pytest.raises(ValueError, match="cannot parse"):
        TensorType.parse("f32(3)")


@pytest.mark.parametrize(
    ("src", "target", "expected"),
    [
        (("T", 576), [-1, 9, 64], ("T", 9, 64)),
        (("T", 9, 64), [-1, 576], ("T", 576)),
        ((4, 6), [-1, 3], (8, 3)),
        (("B", "T"), ["T", -1], ("T", "B")),
    ],
)
def test_symbolic_reshape(src, target, expected) -> None:
    assert resolve_reshape(src, target) == expected


@pytest.mark.parametrize(
    ("src", "target"), [(("T", 6), [-1, 4]), (("T", 6), [-1, -1]), (("T", 6), ["B", -1])]
)
def test_impossible_reshape_is_refused(src, target) -> None:
    with pytest.raises(ShapeError):
        resolve_reshape(src, target)


def test_every_op_is_documented() -> None:
    for op in REGISTRY.values():
        assert op.doc, op.name
        low, high = op.num_inputs
        assert 0 < low <= high


def test_references_agree_with_their_shape_rules() -> None:
    x = torch.randn(5, 8)
    w = torch.randn(4, 8)
    out = REGISTRY["linear"].reference(x, w)
    (rule,) = REGISTRY["linear"].infer([TensorType.of(x), TensorType.of(w)], {})
    assert rule == TensorType.of(out)
    q = torch.randn(5, 2, 8)
    rotated = REGISTRY["rope"].reference(q, torch.arange(5), theta=10000.0)
    assert rotated.shape == q.shape
    assert torch.allclose(rotated[0], q[0])  # position 0 is not rotated
    assert torch.allclose(rotated.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # rotations keep the norm
