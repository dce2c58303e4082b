"""The integer-dot quantized linear (kernels/int_dot.py), every x86 variant this CPU can run and the
aarch64 one under qemu-aarch64, every weight layout, against an exact model of its arithmetic and
against float32 on dequantized weights."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tvm

from kiln.backends.targets import TRIPLES
from kiln.backends.tvm.cpu_features import enable_amx, host_flags
from kiln.backends.tvm.kernels.int_dot import (
    ISAS,
    Plane,
    choose_isa,
    int_dot_gemm_kernel,
    int_dot_tile,
    weight_plane,
)
from kiln.backends.tvm.kernels.linear import QuantSpec
from kiln.backends.tvm.layouts import dot_high, dot_tiled, tiled
from kiln.ir.ops.quant import pack_int4

K, N = 256, 128
ROWS = (1, 3, 4, 7, 13, 16, 35, 64)  # 13: narrow passes, then whole-strip pairs, then one row; 35: AMX
# tiles of 16 rows, then those passes
# (spec, value_bits): every plane the kernel reads
SPECS = (
    (QuantSpec(4, 32, "min"), None),  # GGUF Q4_K, Q4_1: nibbles
    (QuantSpec(4, 128, "zero_point"), None),  # int4, activation blocks of 32 inside a group
    (QuantSpec(8, 16, "symmetric"), None),  # int8 and Q8_0: -128..127, a byte each
    (QuantSpec(8, 16, "symmetric"), 6),  # GGUF Q6_K: -32..31, nibbles and a 2-bit plane
    (QuantSpec(8, 32, "symmetric"), 5),  # GGUF Q5_0: -16..15, nibbles and a 1-bit plane
    (QuantSpec(8, 32, "min"), 5),  # GGUF Q5_K, Q5_1: 0..31
    (QuantSpec(8, 16, "symmetric"), 3),  # GGUF Q3_K: -4..3, nibbles (offset 4)
)
EXPECTED_PLANES = [
    Plane(4, 0),
    Plane(4, 0),
    Plane(8, 128),
    Plane(6, 32),
    Plane(5, 16),
    Plane(5, 0),
    Plane(4, 4),
]
# The CPU each variant is compiled for, and the /proc/cpuinfo flags it needs to run.
VARIANTS = {
    "amx": ("sapphirerapids", {"amx_tile", "amx_int8", "avx512_vnni", "avx512bw"}),
    "vnni512": ("znver5", {"avx512_vnni", "avx512bw"}),
    "vnni256": ("alderlake", {"avx_vnni"}),
    "avx2": ("znver3", {"avx2"}),
}
# run under qemu-aarch64 (conftest.run_aarch64) as that CPU (qemu's neoverse-v1 stand-in is `max`)
EMULATED = {"neon_dot": "cortex-a76", "neon_i8mm": "neoverse-v1"}
# The kernel's sums are exact integers; only the float32 epilogue rounds.
EXACT_TOLERANCE = 1e-5  # against the same arithmetic in float64
FLOAT_TOLERANCE = {8: 2e-2, 16: 1e-4}  # against x @ dequantized W, by activation bits


def _quantize_activations(x: np.ndarray, block: int, bits: int) -> np.ndarray:
    """What the kernel multiplies by: x rounded to `levels` per block of its largest |value|."""
    levels = 127 if bits == 8 else 255 * 127
    blocks = x.reshape(x.shape[0], -1, block)
    scale = np.abs(blocks).max(-1, keepdims=True) / levels
    safe = np.where(scale > 0, scale, 1)
    return (np.round(blocks / safe) * scale).reshape(x.shape)


def _weights(spec: QuantSpec, value_bits: int | None, rng: np.random.Generator, largest: bool = False):
    """Random weights; `largest`: every one the plane's largest stored value."""
    bits = value_bits or spec.bits
    symmetric = spec.scheme == "symmetric"
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if symmetric else (0, 1 << min(bits, 7))
    q = np.full((N, K), high - 1) if largest else rng.integers(low, high, (N, K))
    scales = rng.uniform(1e-3, 2e-2, (N, K // spec.group_size)).astype(np.float32)
    zeros = rng.uniform(-0.1, 0.1, (N, K // spec.group_size)).astype(np.float32)
    s, z = scales.repeat(spec.group_size, 1), zeros.repeat(spec.group_size, 1)
    if spec.scheme == "symmetric":
        dense = s * q
    elif spec.scheme == "min":
        dense = s * q + z
    else:
        dense = s * (q - z)
    return q, scales, zeros, dense.astype(np.float64)


def _inputs(spec: QuantSpec, value_bits: int | None, isa_name: str, largest: bool = False):
    """(weights model, the kernel's constant arguments, per row count the activations) for a variant.
    `largest`: the largest weights and each row one value repeated (every block quantized to +-levels),
    so every integer lane adds up the most it ever can."""
    isa = ISAS[isa_name]
    tile = int_dot_tile(N, spec, isa)
    assert tile is not None
    plane = weight_plane(spec, value_bits)
    assert plane is not None
    rng = np.random.default_rng(spec.group_size + spec.bits)
    q, scales, zeros, dense = _weights(spec, value_bits, rng, largest)
    packing = "pairs" if spec.bits == 4 else "none"
    stored = (
        pack_int4(torch.from_numpy(q).to(torch.uint8), packing)
        if spec.bits == 4
        else torch.from_numpy(q).to(torch.int8)
    )
    main = dot_tiled(stored, spec.bits, packing, tile, plane.bits, plane.offset)
    high = (
        dot_high(stored, spec.bits, packing, tile, plane.bits, plane.offset) if plane.bits in (5, 6) else main
    )
    scale_tiles, zero_tiles = tiled(torch.from_numpy(scales), tile), tiled(torch.from_numpy(zeros), tile)
    constant = [a.numpy() for a in (main, high, scale_tiles, scale_tiles, zero_tiles, zero_tiles)]
    activations = {}
    for rows in ROWS:
        padded = -(-rows // 4) * 4
        if largest:
            x = np.repeat((np.arange(padded) % 2 * 2 - 1) * 3.0, K).reshape(padded, K).astype(np.float32)
        else:
            x = rng.standard_normal((padded, K)).astype(np.float32)
            x[:, :8] *= 20  # an outlier channel, as real activations have
        activations[rows] = x
    return (q, scales, zeros, dense), constant, activations


# What the output's memory holds before the call: integers read as float32, mostly denormals, as a
# workspace reused after integer buffers holds (the row-wise kernels that read the padding rows after
# the linear ran 36x slower on them)
PADDING_GARBAGE = np.arange(1, 64 * 4 * N + 1, dtype=np.int32).view(np.float32)


def _arguments(x: np.ndarray, constant: list[np.ndarray], rows: int) -> list[np.ndarray]:
    blocks = x.shape[0] // 4
    return [
        x.reshape(blocks, 4, K),
        *constant,
        np.zeros(1, np.float32),
        np.array([rows, rows], np.int64),
        np.array(0, np.int64),
        PADDING_GARBAGE[: blocks * 4 * N].reshape(blocks, 4, N).copy(),
    ]


def _check(spec, value_bits, model_weights, x, ours, rows, variant, activation_bits) -> None:
    q, scales, zeros, dense = model_weights
    block = min(spec.group_size, 32)
    exact_x = x[:rows].astype(np.float64)
    quantized_x = _quantize_activations(exact_x, block, activation_bits)
    s, z = scales.repeat(spec.group_size, 1), zeros.repeat(spec.group_size, 1)
    if spec.scheme == "symmetric":
        model = quantized_x @ dense.T
    elif spec.scheme == "min":
        model = quantized_x @ (s * q).T + exact_x @ z.T  # the min term takes the exact row sums
    else:
        model = quantized_x @ (s * q).T - exact_x @ (s * z).T
    exact_error = np.abs(ours - model).max() / np.abs(model).max()
    float_error = np.abs(ours - exact_x @ dense.T).max() / np.abs(exact_x @ dense.T).max()
    assert exact_error < EXACT_TOLERANCE, (variant, spec, rows, exact_error)
    assert float_error < FLOAT_TOLERANCE[activation_bits], (variant, spec, rows, float_error)


def _kernel(spec: QuantSpec, value_bits: int | None, variant: str, activation_bits: int) -> tvm.IRModule:
    plane = weight_plane(spec, value_bits)
    kernel = int_dot_gemm_kernel(K, N, spec, False, ISAS[variant], plane, activation_bits)
    return tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})


@functools.cache
def _library(spec: QuantSpec, value_bits: int | None, variant: str, activation_bits: int) -> Any:
    """The kernel compiled for the variant's CPU, once a process (both tests below run each one)."""
    target = tvm.target.Target({"kind": "llvm", "mtriple": TRIPLES["x86_64"], "mcpu": VARIANTS[variant][0]})
    return tvm.compile(_kernel(spec, value_bits, variant, activation_bits), target=target)


def _run(
    spec: QuantSpec, value_bits: int | None, variant: str, activation_bits: int, largest: bool = False
) -> None:
    needs = VARIANTS[variant][1]
    if not needs <= host_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - host_flags())} for the {variant} variant")
    if variant == "amx" and not enable_amx():
        pytest.skip("this CPU reports AMX, but the kernel does not grant this process its tile data")
    library = _library(spec, value_bits, variant, activation_bits)
    model_weights, constant, activations = _inputs(spec, value_bits, variant, largest)
    device = tvm.cpu()
    for rows, x in activations.items():
        args = _arguments(x, constant, rows)
        tensors = [int(a) if a.ndim == 0 else tvm.runtime.tensor(a, device) for a in args]
        library["main"](*tensors)
        out = tensors[-1].numpy().reshape(-1, N)
        _check(spec, value_bits, model_weights, x, out[:rows], rows, variant, activation_bits)
        assert not out[rows:].any(), "the padding rows keep what the output's memory held, not zeros"


def _id(case: tuple[QuantSpec, int | None]) -> str:
    spec, value_bits = case
    return f"{spec.bits}bit-{spec.scheme}-g{spec.group_size}-v{value_bits or spec.bits}"


@pytest.mark.parametrize("case", SPECS, ids=_id)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("activation_bits", [16, 8])  # 8: kiln compile --activation-bits 8
def test_every_variant_and_plane(
    case: tuple[QuantSpec, int | None], variant: str, activation_bits: int
) -> None:
    """8-bit activations: llama.cpp's Q8 rounding (one int8 dot a weight byte instead of two), about
    1/254 of a block (FLOAT_TOLERANCE)."""
    _run(*case, variant, activation_bits)


@pytest.mark.parametrize("case", SPECS, ids=_id)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_the_largest_sums_fit_their_lanes(
    case: tuple[QuantSpec, int | None], variant: str, activation_bits: int
) -> None:
    """AVX2 adds several rows of 8 k in int16 lanes before widening (4-bit: a block, 5-bit: half of
    one): the largest weights times +-levels must not wrap or saturate anywhere."""
    _run(*case, variant, activation_bits, largest=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "activation_bits"), [("neon_dot", 16), ("neon_dot", 8), ("neon_i8mm", 16), ("neon_i8mm", 8)]
)
def test_the_aarch64_variants_under_qemu(variant: str, activation_bits: int, tmp_path, run_aarch64) -> None:
    jobs, checks = _aarch64_jobs(variant, activation_bits, tmp_path)
    run_aarch64(jobs, EMULATED[variant])
    for spec, value_bits, model_weights, x, rows, name in checks:
        ours = np.load(tmp_path / f"{name}.npy").reshape(-1, N)[:rows]
        _check(spec, value_bits, model_weights, x, ours, rows, variant, activation_bits)


@pytest.mark.slow
def test_qemu_traps_an_instruction_the_target_lacks(tmp_path, aarch64_python, qemu_env) -> None:
    """The i8mm kernel run as a cortex-a76 (no i8mm) dies with SIGILL: the emulated runs check the code
    on its target's CPU, not on qemu's `max`, which has every extension."""
    jobs, _ = _aarch64_jobs("neon_i8mm", 8, tmp_path, specs=SPECS[:1])
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    library_dir = aarch64_python / "site-packages" / "tvm" / "lib"
    command = [
        str(aarch64_python / "run"),
        str(Path(__file__).parents[1] / "emulated_run.py"),
        str(library_dir),
        str(tmp_path / "jobs.json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=qemu_env("cortex-a76"))
    assert done.returncode == -signal.SIGILL, (done.returncode, done.stderr[-2000:])


def _aarch64_jobs(
    variant: str, activation_bits: int, tmp_path: Path, specs: list[Any] | None = None
) -> tuple[list[dict[str, Any]], list[tuple[Any, ...]]]:
    """Each spec's kernel cross-compiled for the variant's CPU, and emulated_run.py's jobs for its inputs."""
    from tvm.support import cc

    target = tvm.target.Target({"kind": "llvm", "mtriple": TRIPLES["aarch64"], "mcpu": EMULATED[variant]})
    jobs, checks = [], []
    for index, (spec, value_bits) in enumerate(specs or SPECS):
        library = tmp_path / f"kernel{index}.so"
        tvm.compile(_kernel(spec, value_bits, variant, activation_bits), target=target).export_library(
            str(library), fcompile=cc.cross_compiler("aarch64-linux-gnu-gcc")
        )
        model_weights, constant, activations = _inputs(spec, value_bits, variant)
        for rows, x in activations.items():
            name = f"kernel{index}-rows{rows}"
            args = _arguments(x, constant, rows)
            np.savez(tmp_path / f"{name}.npz", **{f"arg_{i}": a for i, a in enumerate(args)})
            jobs.append(
                {
                    "library": str(library),
                    "function": "main",
                    "inputs": str(tmp_path / f"{name}.npz"),
                    "output": str(tmp_path / f"{name}.npy"),
                    "result_arg": len(args) - 1,
                }
            )
            checks.append((spec, value_bits, model_weights, x, rows, name))
    return jobs, checks


def test_factored_scales_reproduce_every_scale() -> None:
    """GGUF K-quant scales d * sc (f16 d, small integer sc per group) factor exactly per super-block."""
    from kiln.backends.tvm.layouts import factored

    generator = np.random.default_rng(5)
    d = generator.uniform(1e-5, 1e-1, (64, 2, 1)).astype(np.float16).astype(np.float32)
    sc = generator.integers(-128, 128, (64, 2, 16)).astype(np.float32)
    scales = torch.from_numpy((d * sc).reshape(64, 32))
    base, factors = factored(scales, 16)
    assert torch.equal(base.repeat_interleave(16, 1) * factors.to(torch.float32), scales)
    with pytest.raises(ValueError):
        factored(torch.tensor([[1.0, 1.0 / 3.0]]), 2)


def test_the_tightest_plane_is_chosen() -> None:
    assert [weight_plane(spec, value_bits) for spec, value_bits in SPECS] == EXPECTED_PLANES


def test_variant_choice_follows_the_target_features() -> None:
    assert choose_isa({"avx512f", "avx512bw", "avx512vnni", "amx-tile", "amx-int8"}) is ISAS["amx"]
    assert choose_isa({"avx2", "avx512f", "avx512bw", "avx512vnni"}) is ISAS["vnni512"]
    assert choose_isa({"avx2", "avxvnni"}) is ISAS["vnni256"]
    assert choose_isa({"avx2", "fma"}) is ISAS["avx2"]
    assert choose_isa({"sse4.2"}) is None  # the float32 kernels (quant_gemm.py)
    assert choose_isa({"neon", "dotprod", "fullfp16"}) is ISAS["neon_dot"]
    assert choose_isa({"neon", "dotprod", "i8mm"}) is ISAS["neon_i8mm"]
    assert choose_isa({"neon"}) is None  # Cortex-A72 / A53: no sdot
