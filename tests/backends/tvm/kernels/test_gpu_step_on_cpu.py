"""Every CUDA kernel of a tiny model's `step` and `decode`, run on the CPU: the module the CUDA build
makes (cuda_build.py: lower_graph with the GPU schedules, then the Relax ops fused and scheduled by
dlight's GPU rules), each PrimFunc serialized (gpu_on_cpu.py), the rest of the build's Relax pipeline
run for LLVM, loaded by the CPU runtime (TVMExecutable) and run on the ragged batch and a decode step
against the reference backend. Covers what the per-kernel tests do not build themselves: the fused
Relax kernels (embedding lookups, SwiGLU as split + silu + multiply, GELU, residual adds, reshapes),
the MoE route / grouped / combine kernels, the split-K GEMV of `decode` and the tiled GEMM of `step`
with their real thread bindings and shared-memory tiles, quantized or not; a step with visible_ends
(images whose rows see their later tokens) and a decode step given none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_on_cpu import count_thread_loops, cpu_executable_of_gpu_step, gpu_kernels, gpu_step_module

from kiln.backends.reference import ReferenceExecutable
from kiln.ir.step import VISIBLE_ENDS_INPUT, SequenceSlice, build_step_inputs
from kiln.passes import PassManager, PassOptions, pipeline

BLOCK_SIZE = 16
# relative to the largest |logit|: float32 sums in other orders (tree and split-K reductions, tiles)
TOLERANCE = 1e-5
F16_TOLERANCE = 5e-3  # float16 activations: the two backends round different intermediates


CASES = {  # id: (tiny model, pipeline options, kernel origins or name prefixes that must be present)
    "llama-f32": ("llama", PassOptions(), {"templated (GPU split-K)", "templated (GPU tiled GEMM)"}),
    "llama-int4": ("llama", PassOptions(quantization="int4"), {"templated (GPU split-K)"}),
    "llama-f16": ("llama", PassOptions(dtype="f16"), {"hand-written TIR"}),
    "mixtral": ("mixtral", PassOptions(), {"moe_route", "moe_grouped", "moe_combine"}),
    "gemma3": ("gemma3", PassOptions(), {"hand-written TIR"}),  # sliding-window layers, GELU
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cuda_step_run_on_the_cpu_matches_the_reference(
    case: str, tmp_path: Path, make_tiny_program, ragged_run
):
    kind, options, wanted = CASES[case]
    program = make_tiny_program(kind, tmp_path / "hf", opt_level=0)
    program = PassManager(pipeline(2, options)).run(program, options)[0]
    lowered, module = gpu_step_module(program.graph)
    kernels = gpu_kernels(module)
    found = set(lowered.kernel_origins.values()) | {name.rsplit("_", 1)[0] for name in kernels}
    assert wanted <= found, (wanted - found, lowered.kernel_origins)
    for name, func in kernels.items():  # every kernel is GPU-scheduled: the CPU runs thread loops serially
        assert count_thread_loops(func), f"{name} has no thread-bound loop"
    ours = cpu_executable_of_gpu_step(program, tmp_path / "cpu")
    reference = ReferenceExecutable(program.graph, program.weights)
    tolerance = F16_TOLERANCE if options.dtype == "f16" else TOLERANCE
    mine, theirs = ragged_run([ours, reference], 5)
    for step in range(2):
        error = float((mine[step] - theirs[step]).abs().max() / theirs[step].abs().max())
        assert error < tolerance, (case, step, error)
    decode = build_step_inputs(
        [SequenceSlice([7], 21, [3, 7]), SequenceSlice([9], 35, [1, 5, 9])], BLOCK_SIZE
    )
    got = torch.from_numpy(ours.step(decode, mine[2]))  # `decode`: one block of rows, split-K GEMVs
    expected = torch.from_numpy(reference.step(decode, theirs[2]))
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error < tolerance, (case, "decode", error)


def test_the_cuda_step_with_visible_ends_run_on_the_cpu_matches_the_reference(visible_ends_program, tmp_path):
    ours = cpu_executable_of_gpu_step(visible_ends_program, tmp_path)
    reference = ReferenceExecutable(visible_ends_program.graph, visible_ends_program.weights)
    prompts, tables = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]], [[1], [2]]
    slices = [SequenceSlice(p, 0, t, logits_at=range(len(p))) for p, t in zip(prompts, tables, strict=True)]
    prefill = build_step_inputs(slices, BLOCK_SIZE)
    ends = prefill.positions + 1
    ends[2:7] = 7  # the first prompt's rows 2 .. 6: an image
    prefill = prefill.with_optional({VISIBLE_ENDS_INPUT: ends})
    mine, theirs = (e.kv_cache_spec.allocate(4, BLOCK_SIZE) for e in (ours, reference))
    decode = build_step_inputs(
        [SequenceSlice([20], len(prompts[0]), tables[0]), SequenceSlice([21], len(prompts[1]), tables[1])],
        BLOCK_SIZE,
    )
    for inputs in (prefill, decode):  # the decode: no visible_ends, `decode`
        got, expected = ours.step(inputs, mine), reference.step(inputs, theirs)
        assert float(np.abs(got - expected).max() / np.abs(expected).max()) < TOLERANCE
