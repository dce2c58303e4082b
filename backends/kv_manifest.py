"""The KV cache's entry in a backend's manifest (`kv_cache` in step.json, onnx.json), the width of a
vision-language model's image rows input (`image_rows`) and whether the step takes `visible_ends`:
written at compile, read back at load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.backends.base import KVCacheSpec
from kiln.ir import IMAGE_ROWS_INPUT, VISIBLE_ENDS_INPUT, Graph


def kv_cache_fields(graph: Graph) -> dict[str, Any]:
    """The entry for `graph`'s KV cache input: layers, KV heads, head dim and the IR dtype name."""
    spec = KVCacheSpec.of_graph(graph)
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
    }


def kv_cache_spec(fields: Mapping[str, Any]) -> KVCacheSpec:
    """The spec an entry written by `kv_cache_fields` describes."""
    return KVCacheSpec(
        int(fields["num_layers"]),
        int(fields["num_kv_heads"]),
        int(fields["head_dim"]),
        str(fields["dtype"]),
    )


def image_rows_width(graph: Graph) -> int | None:
    """The hidden size of `graph`'s image rows input (a vision-language model's step), None without one."""
    widths = [int(v.type.shape[1]) for v in graph.inputs if v.name == IMAGE_ROWS_INPUT]
    return widths[0] if widths else None


def takes_visible_ends(graph: Graph) -> bool:
    """Whether `graph`'s step takes visible_ends (a model whose images attend both ways)."""
    return any(value.name == VISIBLE_ENDS_INPUT for value in graph.inputs)
