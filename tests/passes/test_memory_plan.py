"""Memory planning: lifetimes, buffer reuse, and the peak activation bytes of a step."""

from __future__ import annotations

from kiln.ir import parse_graph
from kiln.passes.memory_plan import plan_memory

CHAIN = """\
graph g(%x: f32[T,8]) {
  %0: f32[T,8] = silu(%x)
  %1: f32[T,8] = silu(%0)
  %2: f32[T,8] = silu(%1)
  %3: f32[T,8] = add(%2, %0)
  return %3
}
"""


def test_buffers_are_reused_after_the_last_use() -> None:
    plan = plan_memory(parse_graph(CHAIN), {"T": 4})
    one = 4 * 8 * 4
    assert plan.assignment["2"] == plan.assignment["1"] or plan.assignment["2"] != plan.assignment["0"]
    assert plan.assignment["0"] != plan.assignment["1"]  # %0 is still alive when %1 is made
    assert len(plan.buffer_bytes) == 3 and plan.planned_bytes == 3 * one
    assert plan.peak_live_bytes == 3 * one  # %0, %2 and %3 at the add


def test_smollm2_peak_activation_of_a_prefill(smollm2_built, smollm2_o2) -> None:
    sizes = {"T": 512, "B": 1, "B1": 2, "L": 1, "MB": 32, "NB": 1, "BS": 16}
    naive = plan_memory(smollm2_built.captured.graph, sizes)
    optimized = plan_memory(smollm2_o2.program.graph, sizes)
    logits_all_tokens = 512 * 49152 * 4
    assert naive.peak_live_bytes >= logits_all_tokens  # O0 computes the LM head for every token
    assert optimized.peak_live_bytes < logits_all_tokens / 4
    assert optimized.planned_bytes >= optimized.peak_live_bytes
