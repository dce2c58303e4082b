"""Cleanup passes: golden before/after text, structural equality, remaining ops, same numbers."""

from __future__ import annotations

from kiln.passes.cleanup.canonicalize import canonicalize
from kiln.passes.cleanup.cse import cse
from kiln.passes.cleanup.dce import dce
from kiln.passes.cleanup.fold_constants import fold_constants

SIZES = {"T": 5}


def test_dce_drops_unused_pure_nodes_and_params(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  param @w: f32[4,8]
  param @unused: f32[4,8]
  %0: f32[T,4] = linear(%x, @w)
  %1: f32[T,4] = linear(%x, @unused)
  %2: f32[T,8] = silu(%x)
  return %0
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  param @w: f32[4,8]
  %0: f32[T,4] = linear(%x, @w)
  return %0
}
"""
    after = kit.check(dce, before, expected, SIZES)
    assert set(after.weights) == {"w"}


def test_cse_merges_identical_nodes(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  param @w: f32[4,8]
  %0: f32[T,4] = linear(%x, @w)
  %1: f32[T,4] = linear(%x, @w)
  %2: f32[T,4] = add(%0, %1)
  return %2
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  param @w: f32[4,8]
  %0: f32[T,4] = linear(%x, @w)
  %2: f32[T,4] = add(%0, %0)
  return %2
}
"""
    kit.check(cse, before, expected, SIZES)


def test_fold_constants_computes_weight_only_nodes(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  param @a: f32[4,8]
  param @b: f32[4,8]
  %0: f32[4,8] = add(@a, @b)
  %1: f32[T,4] = linear(%x, %0)
  return %1
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  param @folded.add.0: f32[4,8]
  %1: f32[T,4] = linear(%x, @folded.add.0)
  return %1
}
"""
    after = kit.check(fold_constants, before, expected, SIZES)
    assert set(after.graph.op_counts()) == {"linear"}


def test_canonicalize_reshape_and_transpose_chains_and_noops(kit) -> None:
    before = """\
graph g(%x: f32[T,8]) {
  %0: f32[T,2,4] = reshape(%x) {"shape": [-1, 2, 4]}
  %1: f32[T,4,2] = reshape(%0) {"shape": [-1, 4, 2]}
  %2: f32[T,4,2] = transpose(%1) {"perm": [0, 1, 2]}
  %3: f32[T,4,2] = cast(%2) {"dtype": "f32"}
  %4: f32[2,4,T] = transpose(%3) {"perm": [2, 1, 0]}
  %5: f32[T,2,4] = transpose(%4) {"perm": [2, 0, 1]}
  return %5
}
"""
    expected = """\
graph g(%x: f32[T,8]) {
  %6: f32[T,4,2] = reshape(%x) {"shape": ["T", 4, 2]}
  %7: f32[T,2,4] = transpose(%6) {"perm": [0, 2, 1]}
  return %7
}
"""
    after = kit.check(canonicalize, before, expected, SIZES)
    assert after.graph.op_counts() == {"reshape": 1, "transpose": 1}
