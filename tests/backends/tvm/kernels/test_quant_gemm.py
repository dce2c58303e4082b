"""The float32 quantized linear CPUs without integer dot products run (kernels/quant_gemm.py), on a
partly padded last block of 4 rows: its real rows are x @ dequantize(W).T, its padding rows zeros
whatever the output's memory held before (integers read as float32, mostly denormals: the row-wise
kernels that read those rows after the linear ran 36x slower on them)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from kiln.backends.tvm.kernels.linear import QuantSpec
from kiln.backends.tvm.kernels.quant_gemm import QUANT_TILE, quant_gemm_kernel

K, N = 64, 64
TOLERANCE = 1e-5


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_real_rows_and_zeros_in_the_padding(rows: int) -> None:
    spec = QuantSpec(8, 32, "symmetric", "f32")
    kernel = quant_gemm_kernel(K, N, spec, False).with_attr("global_symbol", "main")
    library = tvm.compile(tvm.IRModule({"main": kernel}), target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(rows)
    values = rng.integers(-128, 128, (N, K)).astype(np.int8)
    scales = rng.uniform(1e-3, 2e-2, (N, K // 32)).astype(np.float32)
    blocks = -(-rows // 4)
    x = np.zeros((blocks * 4, K), np.float32)
    x[:rows] = rng.standard_normal((rows, K))
    strips = N // QUANT_TILE
    tiled_values = values.reshape(strips, QUANT_TILE, K).transpose(0, 2, 1)  # [strip, k, column]
    tiled_scales = scales.reshape(strips, QUANT_TILE, K // 32).transpose(0, 2, 1)
    garbage = np.arange(1, blocks * 4 * N + 1, dtype=np.int32).view(np.float32).reshape(blocks, 4, N)
    arguments = [
        x.reshape(blocks, 4, K),
        np.ascontiguousarray(tiled_values),
        np.ascontiguousarray(tiled_scales),
        np.ascontiguousarray(tiled_scales),  # zeros: unread by the symmetric scheme
        np.zeros(1, np.float32),
        np.array([rows, rows], np.int64),
        np.array(0, np.int64),
        garbage.copy(),
    ]
    device = tvm.cpu()
    tensors = [int(a) if a.ndim == 0 else tvm.runtime.tensor(a, device) for a in arguments]
    library["main"](*tensors)
    out = tensors[-1].numpy().reshape(-1, N)
    expected = x[:rows].astype(np.float64) @ (values * scales.repeat(32, 1)).T.astype(np.float64)
    assert np.abs(out[:rows] - expected).max() / np.abs(expected).max() < TOLERANCE
    assert not out[rows:].any(), "the padding rows keep what the output's memory held, not zeros"
