"""The CPU paged-attention kernel (kernels/attention.py) against the reference op (ir/ops/attention.py),
on a batch mixing prefill runs, chunks, decode rows and padding; and a row's result, bit for bit,
whatever its tile holds (one row alone, a decode row, a long prefill run). The same with visible_ends
(images whose tokens see each other both ways), whose text rows give the causal kernel's bits."""

from __future__ import annotations

import functools

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


@functools.cache
def _compile(
    heads: int, kv_heads: int, head_dim: int, window: int | None, cache_dtype: str, visible_ends: bool = False
):
    """The kernel, compiled once a process: the tests below share 20 of their 60 kernels."""
    kernel = attention_kernel(
        heads, kv_heads, head_dim, SCALE, window, "float32", cache_dtype, visible_ends=visible_ends
    )
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


def _run(
    kernel, q: torch.Tensor, cache: torch.Tensor, tables, contexts, row_counts, padding=0, ends=None
) -> np.ndarray:
    """`ends`: visible_ends, for a kernel that takes them."""
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
        *([] if ends is None else [tvm.runtime.tensor(np.asarray(ends, np.int64), device)]),
        0,
        1.0,
        1.0,
        out,
    )
    return out.numpy()


def _reference(q, cache, tables, contexts, row_counts, window, ends=None) -> np.ndarray:
    starts = torch.tensor(np.concatenate([[0], np.cumsum(row_counts)]), dtype=torch.int64)
    kv_heads, head_dim = cache.shape[-2:]
    unused = torch.zeros((q.shape[0], kv_heads, head_dim))
    visible_ends = None if ends is None else torch.tensor(np.asarray(ends), dtype=torch.int64)
    return paged_attention(
        q, unused, unused, cache.clone(), torch.full((q.shape[0],), -1), tables,
        torch.tensor(contexts), starts, None, visible_ends, layer=0, scale=SCALE, sliding_window=window,
    ).numpy()  # fmt: skip


def _visible_ends(contexts, row_counts, images, padding=0) -> np.ndarray:
    """Each query row's position + 1 (padding rows: 1), except an image's rows, which see up to the
    image's end; `images`: (sequence, its first query row, how many rows)."""
    positions = [
        context - rows + i for context, rows in zip(contexts, row_counts, strict=True) for i in range(rows)
    ]
    ends = np.array(positions + [0] * padding, dtype=np.int64) + 1
    starts = np.concatenate([[0], np.cumsum(row_counts)])
    for seq, first, size in images:
        image = slice(starts[seq] + first, starts[seq] + first + size)
        ends[image] = ends[image][-1]
    return ends


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


# a whole prompt with an image; a later chunk whose image ends the sequence; a chunk with an image over
# several tiles and a second one; a decode row, a sequence without rows this step, a short prompt;
# then 3 padding rows
IMAGE_BATCH = (
    [40, 300, 100, 17, 64, 5],
    [40, 30, 70, 1, 0, 5],
    [(0, 3, 20), (1, 12, 18), (2, 5, 50), (2, 60, 4)],
)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_visible_ends_match_the_reference(shape, window):
    heads, kv_heads, head_dim = shape
    kernel = _compile(heads, kv_heads, head_dim, window, "float32", visible_ends=True)
    contexts, row_counts, images = IMAGE_BATCH
    num_blocks = 128
    cache = _cache(kv_heads, head_dim, num_blocks, "float32", seed=7)
    tables = _tables(contexts, num_blocks, seed=8)
    q = torch.randn((sum(row_counts) + 3, heads, head_dim), generator=torch.Generator().manual_seed(9))
    ends = _visible_ends(contexts, row_counts, images, padding=3)
    got = _run(kernel, q, cache, tables, contexts, row_counts, padding=3, ends=ends)
    expected = _reference(q, cache, tables, contexts, row_counts, window, ends)
    np.testing.assert_allclose(got, expected, rtol=TOLERANCE["float32"], atol=TOLERANCE["float32"])
    assert not got[-3:].any(), "padding rows must be zeros"
    causal = _reference(q, cache, tables, contexts, row_counts, window)
    assert not np.allclose(got[3:23], causal[3:23]), "the image's rows see the image's later tokens"


@pytest.mark.parametrize(("context", "run"), [(90, 70), (2100, 150)], ids=["one-segment", "nine-segments"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_a_row_with_visible_ends_does_not_depend_on_its_tile(shape, window, context, run):
    """A prefill run with an image at rows 10 .. 39: each text row alone, and the image's rows as a
    run of their own (split over several tasks with nine segments) and as the end of a chunk, give the
    whole run's bits, though the image's ends widen the keys of the tiles around them."""
    heads, kv_heads, head_dim = shape
    kernel = _compile(heads, kv_heads, head_dim, window, "float32", visible_ends=True)
    image_first, image_end = 10, 40
    first_position = context - run
    chunk_context = first_position + image_end  # a chunk that ends with the image
    if context > SEGMENT:  # the image's rows alone are split: few tiles, enough segments
        rows = tile_rows(heads // kv_heads, head_dim)
        image_rows = image_end - image_first
        span = max(min(rows, SPAN_FLOOR), min(rows, image_rows // 8))
        assert -(-image_rows // span) * kv_heads < MIN_TASKS
        assert -(-chunk_context // SEGMENT) // SPLIT_SEGMENTS > 1
    num_blocks = -(-context // BLOCK_SIZE) + 1
    cache = _cache(kv_heads, head_dim, num_blocks, "float32", seed=4)
    tables = _tables([context], num_blocks, seed=5)
    q = torch.randn((run, heads, head_dim), generator=torch.Generator().manual_seed(6))
    images = [(0, image_first, image_end - image_first)]
    ends = _visible_ends([context], [run], images)
    whole = _run(kernel, q, cache, tables, [context], [run], ends=ends)
    expected = _reference(q, cache, tables, [context], [run], window, ends)
    np.testing.assert_allclose(whole, expected, rtol=TOLERANCE["float32"], atol=TOLERANCE["float32"])
    for row in (0, 1, image_end, image_end + 17, run - 1):
        position = first_position + row
        alone = _run(kernel, q[row : row + 1], cache, tables, [position + 1], [1], ends=[position + 1])
        assert np.array_equal(alone[0], whole[row]), f"row {row} alone"
    for first in (image_first, 0):
        count, chunk_ends = image_end - first, ends[first:image_end]
        chunk = _run(kernel, q[first:image_end], cache, tables, [chunk_context], [count], ends=chunk_ends)
        assert np.array_equal(chunk, whole[first:image_end]), f"rows {first} .. {image_end - 1}"


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_text_rows_with_visible_ends_give_the_causal_bits(shape, window):
    """Ends of position + 1 (every row text): the causal kernel's result, bit for bit, on the mixed batch
    and on two long decode rows (the split form)."""
    heads, kv_heads, head_dim = shape
    causal = _compile(heads, kv_heads, head_dim, window, "float32")
    with_ends = _compile(heads, kv_heads, head_dim, window, "float32", visible_ends=True)
    num_blocks = 320
    cache = _cache(kv_heads, head_dim, num_blocks, "float32", seed=10)
    for contexts, row_counts in (([37, 300, 100, 64, 5, 17], [37, 1, 20, 0, 5, 1]), ([2100, 700], [1, 1])):
        tables = _tables(contexts, num_blocks, seed=11)
        q = torch.randn((sum(row_counts) + 3, heads, head_dim), generator=torch.Generator().manual_seed(12))
        ends = _visible_ends(contexts, row_counts, [], padding=3)
        expected = _run(causal, q, cache, tables, contexts, row_counts, padding=3)
        got = _run(with_ends, q, cache, tables, contexts, row_counts, padding=3, ends=ends)
        assert np.array_equal(got, expected), contexts
