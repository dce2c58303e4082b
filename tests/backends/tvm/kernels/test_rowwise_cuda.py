"""The row-wise kernels of the CUDA build (kernels/rowwise.py's TE kernels as ops_basic.py and
ops_attention.py make them, scheduled by cuda_build.schedule_gpu: dlight's GPU rules, cross-thread
reductions included), run on the CPU from that TIR (gpu_on_cpu.py) against the IR's ops: RMSNorm,
RMSNorm after a residual add, RoPE (llama3 frequencies, longrope's attention factor). SwiGLU, GELU,
the embeddings and residual adds are Relax ops on GPUs, fused by the build: test_gpu_step_on_cpu.py
runs them inside a model's step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from gpu_on_cpu import CUDA_TARGET, array, build, count_thread_loops

from kiln.backends.tvm.cuda_build import schedule_gpu
from kiln.backends.tvm.kernels import rowwise
from kiln.ir.ops.attention import rope, rope_inv_freq
from kiln.ir.ops.basic import rms_norm
from kiln.ir.ops.fused import add_rms_norm

TOLERANCE = 2e-6  # float32: sums of squares in another order (a tree across threads)
F16_TOLERANCE = 2e-3  # float16 outputs: one rounding of 2^-11 apart at most
DTYPES = {"f32": torch.float32, "f16": torch.float16}


def _gpu(kind: str, func, info: dict):
    with tvm.target.Target(CUDA_TARGET, host={"kind": "llvm"}):
        scheduled, origin = schedule_gpu(kind, func, info)
    assert origin.startswith("dlight"), origin
    assert count_thread_loops(scheduled), f"{kind}: the GPU schedule binds no thread"
    return build(scheduled)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    tolerance = TOLERANCE if dtype == "f32" else F16_TOLERANCE
    np.testing.assert_allclose(got.float().numpy(), expected.float().numpy(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("hidden", [576, 64])  # SmolLM2's hidden size (not a power of 2), a head_dim
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_gpu_rms_norm_matches_the_ir(hidden: int, dtype: str, with_residual: bool) -> None:
    eps = 1e-5
    kernel = _gpu(
        "rms_norm",
        rowwise.rms_norm_kernel(hidden, eps, dtype, with_residual),
        {"hidden": hidden, "with_residual": with_residual},
    )
    generator = torch.Generator().manual_seed(hidden)
    rows = 13
    x, residual = (torch.randn(rows, hidden, generator=generator).to(DTYPES[dtype]) for _ in range(2))
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(DTYPES[dtype])
    normed = array(torch.zeros_like(x))
    if with_residual:
        total = array(torch.zeros_like(x))
        kernel(array(x), array(residual), array(weight), normed, total)
        expected, expected_total = add_rms_norm(x.float(), residual.float(), weight.float(), eps=eps)
        _close(torch.from_dlpack(total), expected_total, dtype)
    else:
        kernel(array(x), array(weight), normed)
        expected = rms_norm(x.float(), weight.float(), eps=eps)
    _close(torch.from_dlpack(normed), expected, dtype)


ROPES = {
    "llama3": {
        "theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "theta": 10000.0,
        "rope_type": "longrope",
        "factors": [1.0, 2.0, 4.0, 8.0],
        "attention_factor": 1.2,
    },
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rope_kind", list(ROPES))
def test_gpu_rope_matches_the_ir(rope_kind: str, dtype: str) -> None:
    attrs = ROPES[rope_kind]
    heads, head_dim = 3, 8
    inv_freq = rope_inv_freq(head_dim, **attrs).numpy()
    scale = float(attrs.get("attention_factor", 1.0))
    kernel = _gpu("rope", rowwise.rope_kernel(heads, head_dim, dtype, scale), {})
    generator = torch.Generator().manual_seed(7)
    rows = 11
    x = torch.randn(rows, heads, head_dim, generator=generator).to(DTYPES[dtype])
    positions = torch.randint(0, 300, (rows,), generator=generator)
    out = array(torch.zeros_like(x))
    kernel(array(x), array(positions), array(rowwise.rope_tables(head_dim, inv_freq)), out)
    expected = rope(x.float(), positions, **attrs)
    _close(torch.from_dlpack(out), expected, dtype)
