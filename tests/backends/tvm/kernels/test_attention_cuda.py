"""The CUDA attention and kv_write kernels (kernels/attention_cuda.py), run on the CPU from their GPU
TIR (gpu_on_cpu.py: thread loops serial, split at the kernel's barriers) against the reference op
(ir/ops/attention.py), on a batch mixing prefill runs, a later chunk, decode rows, a sequence
without rows and padding rows, its pages scattered through the cache (block tables read page by
page). Grouped-query heads (4 and 2 query heads a kv head, and one kv head for all), a sliding
window, float16 activations, float16 / bfloat16 / float8 e4m3 caches, float8 with calibrated
per-layer scales; kv_write with padding slots. With visible_ends, images whose rows see their later
tokens, and the CUDA source of that kernel (cross-compiled, no GPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import tvm
from gpu_on_cpu import array, build, count_thread_loops

from kiln.backends.tvm.cuda_build import schedule_gpu
from kiln.backends.tvm.kernels import attention_cuda
from kiln.ir.ops.attention import paged_attention, to_cache

BLOCK_SIZE = 16
SCALE = 0.125
FP8 = "float8_e4m3fn"
# (heads, kv_heads, head_dim): 4 query heads a kv head (128 threads), MHA with a small head (128
# threads, most idle past head_dim), one kv head for all (64 threads: head_dim 128)
SHAPES = ((8, 2, 64), (4, 4, 16), (4, 1, 128))
# float32 sums in another order than the reference's (per-thread online softmax, then a merge)
TOLERANCE = 2e-5
F16_TOLERANCE = 2e-3  # float16 outputs: both round the float32 result to float16, 1 ulp apart at most
KV_SCALES = (0.5, 2.0)  # float8: calibrated per-layer K and V scales, neither of them 1


def gpu_attention(heads, kv_heads, head_dim, window, dtype, cache_dtype, visible_ends=False):
    """The kernel `step` gets (ops_attention.py's call, then cuda_build.schedule_gpu), built for the CPU."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    attention = attention_cuda.attention_kernel(
        heads, kv_heads, head_dim, SCALE, window, dtype, cache_dtype, visible_ends=visible_ends
    )
    with target:
        kernel, origin = schedule_gpu("attention", attention, {})
    assert origin == "hand-written TIR"
    assert count_thread_loops(kernel) == {"blockIdx.x": 1, "threadIdx.x": 1}
    return build(kernel)


def gpu_kv_write(kv_heads, head_dim, dtype, cache_dtype):
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    with target:
        kernel, _ = schedule_gpu(
            "kv_write", attention_cuda.kv_write_kernel(kv_heads, head_dim, dtype, cache_dtype), {}
        )
    return build(kernel)


def clear_of_subnormals(cache: torch.Tensor) -> torch.Tensor:
    """float8: zeros and subnormals (exponent field 0) moved to the smallest normal, 2^-6, sign kept.
    TVM's LLVM lowering of the native float8 -> float32 cast reads those codes wrong (code 0 as 2^-7;
    kv_format.py), CUDA's conversion is exact: a property of the CPU build, not of the CUDA kernel."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache
    codes = cache.view(torch.uint8).clone()
    low = (codes & 0x78) == 0
    codes[low] = (codes[low] & 0x80) | 0x08
    return codes.view(torch.float8_e4m3fn)


def _cache(kv_heads, head_dim, num_blocks, cache_dtype, scales):
    generator = torch.Generator().manual_seed(1)
    values = torch.randn((2, 2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=generator)
    dtype = getattr(torch, cache_dtype)
    keys, vals = (to_cache(values[:, i] * scales[i], dtype, scales[i]) for i in (0, 1))
    return clear_of_subnormals(torch.stack([keys, vals], dim=1))


def _tables(contexts, num_blocks):
    """Each sequence's pages, drawn without replacement from a shuffled pool (page 0 never used)."""
    pages = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(2)) + 1
    width = max(-(-c // BLOCK_SIZE) for c in contexts)
    tables = torch.zeros((len(contexts), width), dtype=torch.int64)
    for b in range(len(contexts)):
        tables[b] = pages[b * width : (b + 1) * width]
    return tables


ATTENTION_CASES = [  # each shape with and without a window, each dtype pair at least once
    ((8, 2, 64), None, "float32", "float32"),
    ((8, 2, 64), 24, "float16", "float16"),
    ((8, 2, 64), 24, "float16", FP8),
    ((4, 4, 16), None, "float32", "bfloat16"),
    ((4, 4, 16), 24, "float32", "float32"),
    ((4, 1, 128), None, "float16", FP8),
    ((4, 1, 128), 24, "float32", "float32"),
]


def _case_id(case) -> str:
    (heads, kv_heads, head_dim), window, dtype, cache_dtype = case
    span = f"window{window}" if window else "full"
    return f"{heads}x{kv_heads}x{head_dim}-{span}-{dtype}-{cache_dtype}cache"


@pytest.mark.parametrize(
    "shape,window,dtype,cache_dtype", ATTENTION_CASES, ids=map(_case_id, ATTENTION_CASES)
)
def test_gpu_attention_matches_reference(shape, window, dtype, cache_dtype):
    heads, kv_heads, head_dim = shape
    kernel = gpu_attention(heads, kv_heads, head_dim, window, dtype, cache_dtype)
    # a whole prompt, a decode row, a later chunk of a prompt, a sequence without rows this step, a
    # short prompt, another decode row; then 3 padding rows. Layer 1 of a 2-layer cache.
    contexts, row_counts, padding = [37, 300, 100, 64, 5, 17], [37, 1, 20, 0, 5, 1], 3
    num_blocks = 128
    scales = KV_SCALES if cache_dtype == FP8 else (1.0, 1.0)
    cache = _cache(kv_heads, head_dim, num_blocks, cache_dtype, scales)
    tables = _tables(contexts, num_blocks)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(row_counts)]), dtype=torch.int64)
    rows = int(starts[-1]) + padding
    q = torch.randn((rows, heads, head_dim), generator=torch.Generator().manual_seed(3)).to(
        getattr(torch, dtype)
    )
    out = array(torch.full(q.shape, float("nan"), dtype=q.dtype))
    lens = torch.tensor(contexts)
    kernel(array(q), array(cache), array(tables), array(lens), array(starts), 1, *scales, out)
    got = torch.from_dlpack(out).float()
    unused = torch.zeros((rows, kv_heads, head_dim))
    expected = paged_attention(
        q, unused, unused, cache.clone(), torch.full((rows,), -1), tables, lens, starts,
        layer=1, scale=SCALE, sliding_window=window, kv_scale=scales,
    ).float()  # fmt: skip
    tolerance = TOLERANCE if dtype == "float32" else F16_TOLERANCE
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=tolerance, atol=tolerance)
    assert not got[-padding:].any(), "padding rows must be zeros"


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [("float32", "float32"), ("float16", "float16"), ("float16", FP8)],
    ids=["f32", "f16", "fp8"],
)
@pytest.mark.parametrize("shape", [(2, 64), (1, 8)], ids=["2x64", "1x8"])
def test_gpu_kv_write_stores_each_row_in_its_slot(shape, dtype, cache_dtype):
    """Bit for bit the reference's cache: each row's K and V at its slot (pages out of order), padding
    rows (slot -1) write nothing; float8 stores K / k_scale and V / v_scale, saturated at 448."""
    kv_heads, head_dim = shape
    kernel = gpu_kv_write(kv_heads, head_dim, dtype, cache_dtype)
    generator = torch.Generator().manual_seed(4)
    rows, num_blocks = 23, 8
    scales = KV_SCALES if cache_dtype == FP8 else (1.0, 1.0)
    k, v = (torch.randn((rows, kv_heads, head_dim), generator=generator) * s for s in scales)
    if cache_dtype == FP8:  # above float8's range (saturates) and clear of its subnormals (see above)
        k[0, 0, 0] = 1000.0
        k, v = ((x.abs().clamp(min=0.05 * s) * x.sign()) for x, s in ((k, scales[0]), (v, scales[1])))
    k, v = k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:rows]
    slots[[3, 11, 22]] = -1
    cache = torch.zeros((2, 2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), dtype=getattr(torch, cache_dtype))
    cache_array = array(cache)
    kernel(array(k), array(v), cache_array, array(slots), 1, *scales)
    expected = cache.clone()
    no_rows = torch.zeros(2, dtype=torch.int64)  # one sequence without query rows: the write only
    paged_attention(
        k.new_zeros((rows, 1, head_dim)), k, v, expected, slots, no_rows[None, :1], no_rows[:1], no_rows,
        layer=1, scale=SCALE, kv_scale=scales,
    )  # fmt: skip
    got = torch.from_dlpack(cache_array)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert not got[0].view(torch.uint8).any(), "layer 0 untouched"


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("shape", [(8, 2, 64), (4, 1, 128)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_attention_with_visible_ends_matches_reference(shape, window):
    """A whole prompt with an image, a later chunk whose image ends the sequence, a decode row, a
    sequence without rows, a prompt of text; 3 padding rows. An image's rows see up to its end."""
    heads, kv_heads, head_dim = shape
    kernel = gpu_attention(heads, kv_heads, head_dim, window, "float32", "float32", visible_ends=True)
    contexts, row_counts, padding = [40, 300, 17, 64, 5], [40, 30, 1, 0, 5], 3
    images = [(0, 3, 20), (1, 12, 18)]  # (sequence, its first query row, rows)
    num_blocks = 128
    cache = _cache(kv_heads, head_dim, num_blocks, "float32", (1.0, 1.0))
    tables = _tables(contexts, num_blocks)
    starts = torch.tensor(np.concatenate([[0], np.cumsum(row_counts)]), dtype=torch.int64)
    rows = int(starts[-1]) + padding
    positions = [c - r + i for c, r in zip(contexts, row_counts, strict=True) for i in range(r)]
    ends = torch.tensor(positions + [0] * padding) + 1
    for seq, first, size in images:
        image = slice(int(starts[seq]) + first, int(starts[seq]) + first + size)
        ends[image] = ends[image][-1].item()
    q = torch.randn((rows, heads, head_dim), generator=torch.Generator().manual_seed(3))
    out = array(torch.full(q.shape, float("nan")))
    lens = torch.tensor(contexts)
    kernel(array(q), array(cache), array(tables), array(lens), array(starts), array(ends), 1, 1.0, 1.0, out)
    got = torch.from_dlpack(out)
    unused = torch.zeros((rows, kv_heads, head_dim))
    expected = paged_attention(
        q, unused, unused, cache.clone(), torch.full((rows,), -1), tables, lens, starts, None, ends,
        layer=1, scale=SCALE, sliding_window=window,
    )  # fmt: skip
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=TOLERANCE, atol=TOLERANCE)
    assert not got[-padding:].any(), "padding rows must be zeros"
    causal = paged_attention(
        q, unused, unused, cache.clone(), torch.full((rows,), -1), tables, lens, starts,
        layer=1, scale=SCALE, sliding_window=window,
    )  # fmt: skip
    assert not torch.allclose(got[3:23], causal[3:23]), "the image's rows see its later tokens"


def test_gpu_attention_with_visible_ends_cross_compiles():
    """CUDA codegen (no nvcc, no GPU) of the kernel with visible_ends: the causal kernel's pointers and
    `ends`, an int64 one."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    kernels = {
        name: attention_cuda.attention_kernel(8, 2, 128, 0.088, 64, "float16", visible_ends=visible_ends)
        for name, visible_ends in (("with_ends", True), ("causal", False))
    }
    module = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in kernels.items()})
    with target:
        source = tvm.tirx.build(module, target=target).imports[0].inspect_source("cuda")
    signatures = dict(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\)", source))
    assert set(signatures) == {"with_ends_kernel", "causal_kernel"}
    pointers = {name: re.findall(r"\* __restrict__ (\w+)_ptr", text) for name, text in signatures.items()}
    assert sorted(pointers["with_ends_kernel"]) == sorted([*pointers["causal_kernel"], "ends"])
    assert "int64_t* __restrict__ ends_ptr" in signatures["with_ends_kernel"]
