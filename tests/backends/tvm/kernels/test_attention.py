"""The CPU paged-attention kernel (kernels/attention.py) against the reference op (ir/ops/attention.py),
on a batch mixing prefill runs, chunks, decode rows and padding; and a row's result, bit for bit,
whatever its tile holds (one row alone, a decode row, a long prefill run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm

from kiln.backends.targets import Target
from kiln.backends.tvm.cpu import llvm_target
from kiln.backends.tvm.kernels.attention import (
    MIN_TASKS,
    SEGMENT,
    SPAN_FLOOR,
    SPLIT_SEGMENTS,
    attention_kernel,
    tile_rows,
)
from kiln.ir.ops.attention import paged_attention, to_cache

BLOCK_SIZE = 16
SCALE = 0.125
# (heads, kv_heads, head_dim): SmolLM2, Qwen2.5-0.5B, Gemma 3 270M's shape; a small head
SHAPES = ((9, 3, 64), (14, 2, 64), (4, 1, 256), (6, 6, 16))
# float32 sums in another order and a polynomial exp (2 ulp): close to the reference, not equal
TOLERANCE = {"float32": 2e-5, "float16": 2e-5, "bfloat16": 2e-5, "float8_e4m3fn": 2e-5}
FP8 = "float8_e4m3fn"


def _compile(heads: int, kv_heads: int, head_dim: int, window: int | None, cache_dtype: str):
    kernel = attention_kernel(heads, kv_heads, head_dim, SCALE, window, "float32", cache_dtype)
    module = tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})
    return tvm.compile(module, target=llvm_target(Target("cpu")))["main"]


def _cache(kv_heads: int, head_dim: int, num_blocks: int, cache_dtype: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((1, 2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=generator)
    return to_cache(values, getattr(torch, cache_dtype), 1.0)


def _tables(contexts: list[int], num_blocks: int, seed: int) -> torch.Tensor:
    """Each sequence's pages, drawn without replacement from a shuffled pool (page 0 never used)."""
    pages = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    width = max(-(-c // BLOCK_SIZE) for c in contexts)
    tables = torch.zeros((len(contexts), width), dtype=torch.int64)
    for b in range(len(contexts)):
        tables[b] = pages[b * width : (b + 1) * width]
    return tables


def _run(kernel, q: torch.Tensor, cache: torch.Tensor, tables, contexts, row_counts, padding=0) -> np.ndarray:
    starts = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    n = int(starts[-1]) + padding
    assert q.shape[0] == n
    device = tvm.cpu()
    cache_array = tvm.runtime.from_dlpack(cache.contiguous())  # float8 too, which numpy lacks
    out = tvm.runtime.tensor(np.full(q.shape, np.nan, np.float32), device)
    kernel(
        tvm.runtime.tensor(q.numpy(), device),
        cache_array,
        tvm.runtime.tensor(tables.numpy(), device),
        tvm.runtime.tensor(np.array(contexts, np.int64), device),
        tvm.runtime.tensor(starts, device),
        0,
        1.0,
        1.0,
        out,
    )
    return out.numpy()


def _reference(q, cache, tables, contexts, row_counts, window) -> np.ndarray:
    starts = torch.tensor(np.concatenate([[0], np.cumsum(row_counts)]), dtype=torch.int64)
    kv_heads, head_dim = cache.shape[-2:]
    unused = torch.zeros((q.shape[0], kv_heads, head_dim))
    return paged_attention(
        q, unused, unused, cache.clone(), torch.full((q.shape[0],), -1), tables,
        torch.tensor(contexts), starts, layer=0, scale=SCALE, sliding_window=window,
    ).numpy()  # fmt: skip


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", FP8])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_on_a_mixed_batch(shape, window, cache_dtype):
    heads, kv_heads, head_dim = shape
    kernel = _compile(heads, kv_heads, head_dim, window, cache_dtype)
    # a whole prompt, a decode row, a later chunk of a prompt, a sequence without rows this step, a
    # short prompt, another decode row; then 3 padding rows
    contexts, row_counts = [37, 300, 100, 64, 5, 17], [37, 1, 20, 0, 5, 1]
    num_blocks = 128
    cache = _cache(kv_heads, head_dim, num_blocks, cache_dtype, seed=1)
    tables = _tables(contexts, num_blocks, seed=2)
    q = torch.randn((sum(row_counts) + 3, heads, head_dim), generator=torch.Generator().manual_seed(3))
    got = _run(kernel, q, cache, tables, contexts, row_counts, padding=3)
    expected = _reference(q, cache, tables, contexts, row_counts, window)
    np.testing.assert_allclose(got, expected, rtol=TOLERANCE[cache_dtype], atol=TOLERANCE[cache_dtype])
    assert not got[-3:].any(), "padding rows must be zeros"


@pytest.mark.parametrize(("context", "run"), [(90, 70), (2100, 150)], ids=["one-segment", "nine-segments"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_a_row_does_not_depend_on_its_tile(shape, window, context, run):
    """Each row of a prefill run, recomputed as a run of one and inside a run of 3 (speculative
    verification), gives the same bits: the tiles, key blocks and segments never change a row's sums.
    With nine segments the long run has enough tiles to keep each in one task, while a row alone
    splits its segments over several tasks, merged in a second loop; the run is also checked against
    the reference there."""
    heads, kv_heads, head_dim = shape
    kernel = _compile(heads, kv_heads, head_dim, window, "float32")
    assert SPAN_FLOOR < run  # the run spans several tiles
    rows = tile_rows(heads // kv_heads, head_dim)
    span = max(min(rows, SPAN_FLOOR), min(rows, run // 8))  # as the kernel tiles a run
    if context > SEGMENT:
        assert -(-run // span) * kv_heads >= MIN_TASKS  # the long run is not split
        segments = -(-(context - run + 1) // SEGMENT)  # the first row alone: one tile a KV head
        assert min(-(-MIN_TASKS // kv_heads), segments // SPLIT_SEGMENTS) > 1  # it is split
    num_blocks = -(-context // BLOCK_SIZE) + 1
    cache = _cache(kv_heads, head_dim, num_blocks, "float32", seed=4)
    tables = _tables([context], num_blocks, seed=5)
    q = torch.randn((run, heads, head_dim), generator=torch.Generator().manual_seed(6))
    whole = _run(kernel, q, cache, tables, [context], [run])
    if context > SEGMENT:
        expected = _reference(q, cache, tables, [context], [run], window)
        np.testing.assert_allclose(whole, expected, rtol=TOLERANCE["float32"], atol=TOLERANCE["float32"])
    first_position = context - run
    for row in (0, 1, 17, 33, run - 1):
        alone = _run(kernel, q[row : row + 1], cache, tables, [first_position + row + 1], [1])
        assert np.array_equal(alone[0], whole[row]), f"row {row} alone"
    triple = _run(kernel, q[30:33], cache, tables, [first_position + 33], [3])
    assert np.array_equal(triple, whole[30:33])
