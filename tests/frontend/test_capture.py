"""fx capture: one golden graph per supported target, and errors that name the node and the line."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.capture import CaptureError, capture_module
from kiln.frontend.ops import paged_attention, rms_norm, rope
from kiln.ir import TensorType, parse_graph, print_graph, structural_equal

X = {"x": TensorType("f32", ("T", 8))}


class _Linear(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=bias)

    def forward(self, x):
        return F.linear(x, self.proj.weight, self.proj.bias)


class _Elementwise(nn.Module):
    def forward(self, x):
        return operator.add(F.silu(x), torch.mul(x, x))


class _Reshape(nn.Module):
    def forward(self, x):
        return x.view(-1, 2, 4).reshape(-1, 8)


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(16, 8)

    def forward(self, ids, rows):
        return torch.index_select(F.embedding(ids, self.table.weight), 0, rows)


class _NormRope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(8))

    def forward(self, x, positions):
        return rope(rms_norm(x, self.norm, eps=1e-5).view(-1, 2, 4), positions, theta=10000.0)


class _Attention(nn.Module):
    def forward(self, q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
        return paged_attention(
            q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, layer=0, scale=0.5
        )


ATTENTION_INPUTS = {
    "q": TensorType("f32", ("T", 4, 8)),
    "k": TensorType("f32", ("T", 2, 8)),
    "v": TensorType("f32", ("T", 2, 8)),
    "kv_cache": TensorType("f32", (1, 2, "NB", "BS", 2, 8)),
    "slot_mapping": TensorType("i64", ("T",)),
    "block_tables": TensorType("i64", ("B", "MB")),
    "seq_lens": TensorType("i64", ("B",)),
    "query_start_loc": TensorType("i64", ("B1",)),
}

CASES = {
    "linear": (_Linear(False), X, ["%0: f32[T,4] = linear(%x, @proj.weight)"]),
    "linear_bias": (_Linear(True), X, ["%0: f32[T,4] = linear(%x, @proj.weight, @proj.bias)"]),
    "elementwise": (
        _Elementwise(),
        X,
        ["%0: f32[T,8] = silu(%x)", "%1: f32[T,8] = mul(%x, %x)", "%2: f32[T,8] = add(%0, %1)"],
    ),
    "reshape": (
        _Reshape(),
        X,
        [
            '%0: f32[T,2,4] = reshape(%x) {"shape": [-1, 2, 4]}',
            '%1: f32[T,8] = reshape(%0) {"shape": [-1, 8]}',
        ],
    ),
    "embedding": (
        _Embed(),
        {"ids": TensorType("i64", ("T",)), "rows": TensorType("i64", ("B",))},
        ["%0: f32[T,8] = embedding(@table.weight, %ids)", "%1: f32[B,8] = take_rows(%0, %rows)"],
    ),
    "norm_rope": (
        _NormRope(),
        {**X, "positions": TensorType("i64", ("T",))},
        [
            '%0: f32[T,8] = rms_norm(%x, @norm) {"eps": 1e-05}',
            '%1: f32[T,2,4] = reshape(%0) {"shape": [-1, 2, 4]}',
            '%2: f32[T,2,4] = rope(%1, %positions) {"theta": 10000.0}',
        ],
    ),
    "paged_attention": (
        _Attention(),
        ATTENTION_INPUTS,
        [
            "%0: f32[T,4,8] = paged_attention(%q, %k, %v, %kv_cache, %slot_mapping, %block_tables, "
            '%seq_lens, %query_start_loc) {"layer": 0, "scale": 0.5}'
        ],
    ),
}


def _strip_sources(text: str) -> str:
    return "\n".join(line.split("  # ")[0] for line in text.splitlines())


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_capture(case: str) -> None:
    module, inputs, body = CASES[case]
    graph = capture_module(module, inputs, case)
    printed = _strip_sources(print_graph(graph))
    node_lines = [line.strip() for line in printed.splitlines() if line.strip().startswith("%")]
    assert node_lines == body
    assert structural_equal(parse_graph(printed), graph)
    assert all((node.source or "").startswith("tests/frontend/test_capture.py:") for node in graph.nodes)


class _Unsupported(nn.Module):
    def forward(self, x):
        y = F.silu(x)
        return torch.sin(y)  # no IR op for sin


def test_unsupported_target_names_node_target_and_line() -> None:
    with pytest.raises(CaptureError) as raised:
        capture_module(_Unsupported(), X, "bad")
    message = str(raised.value)
    assert "call_function[target=torch.sin](args = (%silu,)" in message
    assert "target sin" in message
    assert "test_capture.py:" in message and "return torch.sin(y)" in message


def test_input_missing_from_the_spec_is_named() -> None:
    with pytest.raises(CaptureError, match="input 'x' that the input spec lacks"):
        capture_module(_Elementwise(), {"y": TensorType("f32", (2,))}, "bad")
