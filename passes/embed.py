"""The `embed` entry point's graph: the step's graph up to the LM head, returning the final hidden states
(after the model's last norm) of the `logits_indices` rows instead of their logits.

Taken from the optimized step graph, so it shares every kernel and weight with the step; only the LM head
(and a final soft-cap or cast) is left out. A graph whose output does not come from one linear layer (a
tensor-parallel shard gathers its logits) has no embed graph.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, TensorType, Value, ValueKind
from kiln.ir.step import EMBED
from kiln.passes.rewriter import live_nodes

# what may stand between the LM head and the step's output (take_rows: in a graph before the passes)
_AFTER_HEAD = ("softcap", "cast", "take_rows")
_HEADS = ("linear", "quantized_linear")


def _lm_head(graph: Graph) -> tuple[Node, Node | None] | None:
    """The LM head and the take_rows after it, if any."""
    if len(graph.outputs) != 1:
        return None
    made_by = {value.name: node for node in graph.nodes for value in node.outputs}
    node = made_by.get(graph.outputs[0].name)
    take_rows = None
    while node is not None and node.op in _AFTER_HEAD and node.inputs[0] is not None:
        take_rows = node if node.op == "take_rows" else take_rows
        node = made_by.get(node.inputs[0].name)
    if node is None or node.op not in _HEADS or node.inputs[0] is None:
        return None
    return node, take_rows


def embed_graph(graph: Graph) -> Graph | None:
    """`graph` returning its LM head's input rows [L, hidden]; None where it has no single LM head. Its
    params are the step's, less the head's, in the step's order."""
    found = _lm_head(graph)
    if found is None:
        return None
    head, take_rows = found
    hidden = head.inputs[0]
    assert hidden is not None
    nodes = live_nodes(graph.nodes, [hidden])
    if take_rows is not None:
        rows_type = TensorType(hidden.type.dtype, ("L", *hidden.type.shape[1:]))
        rows = Value(f"{hidden.name}_rows", rows_type, ValueKind.NODE)
        nodes.append(Node("take_rows", (hidden, take_rows.inputs[1]), (rows,), source=take_rows.source))
        hidden = rows
    read = {value.name for node in nodes for value in node.inputs if value is not None}
    params = [param for param in graph.params if param.name in read]
    return Graph(f"{graph.name}_{EMBED}", list(graph.inputs), params, nodes, [hidden])
