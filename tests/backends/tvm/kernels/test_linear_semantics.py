"""The quantized linear a CUDA artifact runs (kernels/linear.py: weights dequantized inside the
reduction; cuda_build.py tiles it into a split-K GEMV for `decode` and a tiled GEMM for `step`), run
on the CPU: the same TIR built for LLVM, unscheduled and with each GPU schedule's loops left serial
(their arithmetic, masks and write-back regions; not the threads' cooperation), fed the weights in
the layouts the lowering gives it, against the IR's quantized_linear on the same weights. Every
layout the GPU path takes: 4-bit in both packings (int4's zero point, GGUF's min), 8-bit symmetric
with int8 and GGUF K-quant value ranges, float32 and float16 scales, with and without bias; float32
activations (float32 rounding), and float16 ones (`--dtype f16` on a GPU: float32 sums, float16
rounding of the output). The GPU schedules also run as compiled, with their thread bindings and
shared-memory tiles, each thread-bound loop made serial (gpu_on_cpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from gpu_on_cpu import count_thread_loops, serialize

from kiln.backends.tvm.cuda_build import schedule_gemm_gpu, schedule_linear_gpu
from kiln.backends.tvm.kernels.linear import ROW_BLOCK, QuantSpec, column_tile, linear_kernel
from kiln.backends.tvm.layouts import apply_layout, int4_tiled_transform, tiled_transform
from kiln.ir.ops.quant import pack_int4, quantized_linear

K, N = 256, 96  # 96: strips of 32 columns, not the 64 a wider matrix gets; 1.5 GEMM column tiles
TOLERANCE = 1e-5  # relative to the largest |output|: float32 sums in another order
F16_TOLERANCE = 2e-3  # float16 outputs: a relative rounding of 2^-11 of each value

CASES = [  # (bits, group, scheme, packing, value range, scale dtype)
    (4, 128, "zero_point", "pairs", (0, 16), torch.float32),  # --quantization int4
    (4, 32, "min", "gguf", (0, 16), torch.float16),  # GGUF Q4_1, Q4_K (scales d * sc)
    (4, 32, "zero_point", "gguf", (0, 16), torch.float16),  # GGUF Q4_0 (zero 8)
    (8, 256, "symmetric", "none", (-128, 128), torch.float32),  # --quantization int8
    (8, 32, "symmetric", "none", (-128, 128), torch.float16),  # GGUF Q8_0
    (8, 32, "symmetric", "none", (-16, 16), torch.float16),  # GGUF Q5_0
    (8, 16, "symmetric", "none", (-32, 32), torch.float32),  # GGUF Q6_K
    (8, 32, "min", "none", (0, 32), torch.float32),  # GGUF Q5_K, Q5_1
]


def _id(case: tuple) -> str:
    bits, group, scheme, packing, (low, high), dtype = case
    return f"{bits}bit-g{group}-{scheme}-{packing}-{low}..{high - 1}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_gpu_linears_tir_computes_quantized_linear(case: tuple, has_bias: bool) -> None:
    _check(case, has_bias, torch.float32, TOLERANCE)


@pytest.mark.parametrize("case", CASES[:2] + CASES[4:6], ids=_id)
def test_float16_activations_sum_in_float32(case: tuple) -> None:
    """`--dtype f16` on a GPU: float16 in and out, the reduction in float32; against the IR in float32
    on the same float16 inputs, so the error is the output's float16 rounding."""
    _check(case, True, torch.float16, F16_TOLERANCE)


@pytest.mark.parametrize("case", CASES[:2] + CASES[4:5] + CASES[6:7], ids=_id)
@pytest.mark.parametrize("schedule", [schedule_linear_gpu, schedule_gemm_gpu], ids=["split_k", "gemm"])
@pytest.mark.parametrize("activations", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("threads", [False, True], ids=["serial", "threads"])
def test_the_gpu_schedules_keep_the_sums(
    case: tuple, schedule, activations: torch.dtype, threads: bool
) -> None:
    """37 rows: one full GEMM row tile of 32 and a masked one; 96 columns: a full and a half tile.
    `threads`: the schedule the CUDA build compiles (thread bindings, the split-K's cross-thread
    reduction, the GEMM's shared-memory weight tile and register sums), run serially (gpu_on_cpu.py)."""
    tolerance = TOLERANCE if activations == torch.float32 else F16_TOLERANCE
    if threads:

        def scheduled(f):
            func = schedule(f, threads=True)
            assert count_thread_loops(func), "the GPU schedule binds no thread"
            return serialize(func)

    else:

        def scheduled(f):
            return schedule(f, threads=False)

    _check(case, True, activations, tolerance, rows=37, schedule=scheduled)


def _check(
    case: tuple, has_bias: bool, activations: torch.dtype, tolerance: float, rows: int = 7, schedule=None
) -> None:
    bits, group, scheme, packing, (low, high), scale_dtype = case
    generator = torch.Generator().manual_seed(bits * 1000 + group + low)
    values = torch.randint(low, high, (N, K), generator=generator)
    qweight = pack_int4(values.to(torch.uint8), packing) if bits == 4 else values.to(torch.int8)
    scales = (torch.rand(N, K // group, generator=generator) * 0.02 + 1e-3).to(scale_dtype)
    zeros = None if scheme == "symmetric" else (torch.rand(N, K // group, generator=generator) - 0.5)
    zeros = zeros.to(scale_dtype) if zeros is not None else None
    bias = torch.randn(N, generator=generator).to(activations) if has_bias else None
    x = torch.randn(rows, K, generator=generator).to(activations)
    expected = quantized_linear(
        x.float(),
        qweight,
        scales,
        zeros,
        None if bias is None else bias.float(),
        bits=bits,
        group_size=group,
        scheme=scheme,
        packing=packing,
    )

    tile = column_tile(N)
    dtype_name = {torch.float32: "f32", torch.float16: "f16"}[scale_dtype]
    spec = QuantSpec(bits, group, scheme, dtype_name)
    kernel = linear_kernel(K, N, {torch.float32: "f32", torch.float16: "f16"}[activations], spec, has_bias)
    if schedule is not None:
        kernel = schedule(kernel)
    library = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target="llvm")
    weight_layout = int4_tiled_transform(packing, tile) if bits == 4 else tiled_transform(tile)
    laid_out = [apply_layout(weight_layout, qweight), apply_layout(tiled_transform(tile), scales)]
    if zeros is not None:
        laid_out.append(apply_layout(tiled_transform(tile), zeros))
    if bias is not None:
        laid_out.append(bias)
    blocks = -(-rows // ROW_BLOCK)
    padded = torch.zeros(blocks * ROW_BLOCK, K, dtype=activations)
    padded[:rows] = x
    device = tvm.cpu()
    out_dtype = np.float16 if activations == torch.float16 else np.float32
    out = tvm.runtime.tensor(np.zeros((blocks, ROW_BLOCK, N), out_dtype), device)
    arguments = [padded.reshape(blocks, ROW_BLOCK, K), *laid_out]
    library["main"](*[tvm.runtime.tensor(a.contiguous().numpy(), device) for a in arguments], out)
    ours = torch.from_numpy(out.numpy().reshape(-1, N)[:rows]).float()
    error = float((ours - expected).abs().max() / expected.abs().max())
    assert error < tolerance, (case, has_bias, activations, error)
