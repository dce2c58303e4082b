"""TVM-CPU against the reference backend on the same programs: tiny HF models of every supported
architecture, SmolLM2 float32 and its imported GGUF blocks; greedy tokens; batch invariance in the
engine; clear refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.backends.base import BackendError, CompileSettings
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.backends.tvm.cpu_features import enable_amx, host_flags
from kiln.ir import KV_CACHE_INPUT
from kiln.ir.host_arrays import as_torch, ir_dtype_of
from kiln.ir.step import SequenceSlice, StepSignature, build_step_inputs
from kiln.passes import PassManager, PassOptions, pipeline
from kiln.runtime.greedy import greedy_generate

BLOCK_SIZE = 16
TOLERANCE = 1e-4  # max |tvm - reference| / max |reference|
# Quantized linears on this CPU use integer dot products over 16-bit quantized activations
# (kernels/int_dot.py): measured 1.8e-4 to 2.1e-4 on the models below.
QUANTIZED_TOLERANCE = 1e-3
FLOAT_PATH_CPU = Target("cpu", "x86-64-v2")  # no AVX2: the float32 quantized kernels (quant_gemm.py)


def _relative_error(ours: torch.Tensor | np.ndarray, theirs: torch.Tensor | np.ndarray) -> float:
    ours, theirs = (as_torch(x).float() if isinstance(x, np.ndarray) else x.float() for x in (ours, theirs))
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.slow
def test_tiny_models_match_the_reference(
    tiny_kind: str, tmp_path: Path, tvm_compile, make_tiny_program, ragged_run
) -> None:
    kind = tiny_kind
    program = make_tiny_program(kind, tmp_path / "hf", opt_level=2)
    tvm = tvm_compile(program, tmp_path / "tvm")
    reference = ReferenceExecutable(program.graph, program.weights)
    ours, theirs = ragged_run([tvm, reference], 1234)
    for step in range(2):
        assert ours[step].shape == theirs[step].shape
        assert _relative_error(ours[step], theirs[step]) < TOLERANCE, (kind, step)
    assert _relative_error(ours[2], theirs[2]) < TOLERANCE  # the K/V written into the cache


@pytest.mark.slow
def test_smollm2_float32_logits_and_greedy_tokens(smollm2_o2, smollm2_tvm) -> None:
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, 49000, (40,), generator=generator).tolist()
    inputs = build_step_inputs([SequenceSlice(prompt, 0, [2, 0, 5])], BLOCK_SIZE)
    ours = torch.from_numpy(smollm2_tvm.step(inputs, smollm2_tvm.kv_cache_spec.allocate(6, BLOCK_SIZE)))
    theirs = torch.from_numpy(
        smollm2_o2.executable.step(inputs, smollm2_o2.executable.kv_cache_spec.allocate(6, BLOCK_SIZE))
    )
    assert _relative_error(ours, theirs) < TOLERANCE

    chat = smollm2_o2.tokenizer.encode("The three primary colours are")
    assert greedy_generate(smollm2_tvm, chat, 32) == greedy_generate(smollm2_o2.executable, chat, 32)


@pytest.mark.slow
def test_smollm2_gguf_blocks_match_the_reference(smollm2_gguf_path: Path, check_batch_invariance) -> None:
    """The default path's artifact (TVM for this CPU, the GGUF's Q4_1 / Q8_0 blocks, a float16 KV
    cache): the compile cache's entry that `kiln.LLM`, `kiln serve` and the SmolLM2 tests load, so the
    suite compiles it once; against the reference backend on the same program. Also batch-invariant:
    each row's activations are quantized on their own and its integer dot products are exact, whatever
    the rows beside it. (`--activation-bits 8` on this model, a compile of its own:
    `bench/agreement.py activation-bits-error`.)"""
    import kiln
    from kiln.compiler import ModelOptions, resolve
    from kiln.compiler.build import build_reference
    from kiln.llm import describe

    built = build_reference(str(smollm2_gguf_path), resolve(ModelOptions(str(smollm2_gguf_path))).pipeline())
    ops = built.program.graph.op_counts()
    assert ops["quantized_linear"] == 30 * 4 + 1  # Q4_1 layers and the Q8_0 LM head
    llm = kiln.LLM(str(smollm2_gguf_path), show_progress=False)
    try:
        assert describe(llm.artifact).startswith("backend tvm, target cpu")
        tvm = llm.artifact.executable
        prompt = built.tokenizer.encode("A kiln fires clay at a high temperature")
        inputs = build_step_inputs([SequenceSlice(prompt, 0, [1, 3])], BLOCK_SIZE)
        ours = torch.from_numpy(tvm.step(inputs, tvm.kv_cache_spec.allocate(4, BLOCK_SIZE)))
        reference = built.executable
        theirs = torch.from_numpy(reference.step(inputs, reference.kv_cache_spec.allocate(4, BLOCK_SIZE)))
        assert _relative_error(ours, theirs) < QUANTIZED_TOLERANCE
        assert greedy_generate(tvm, prompt, 16) == greedy_generate(reference, prompt, 16)
        check_batch_invariance(tvm, built.tokenizer, "tvm-gguf")
    finally:
        llm.close()


def test_loading_leaves_the_cores_to_tvm(tmp_path: Path, tvm_compile, make_tiny_program) -> None:
    """torch's OpenMP pool would spin-wait on the cores TVM's workers need (decode 2x slower)."""
    torch.set_num_threads(2)
    tvm_compile(make_tiny_program("llama", tmp_path / "hf", opt_level=2), tmp_path / "tvm")
    assert torch.get_num_threads() == 1


@pytest.mark.slow
def test_held_weight_bytes_are_what_the_kernels_read(tmp_path: Path, tvm_compile, make_tiny_program) -> None:
    """bench/compare.py's bandwidth ceiling counts each weight as the compiled code holds it: every
    laid-out parameter of step.json, 4-bit weights as packed nibbles."""
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    options = PassOptions(quantization="int4", quantize_lm_head=True)
    quantized, _ = PassManager(pipeline(2, options)).run(program, options)
    held = tvm_compile(quantized, tmp_path / "tvm").held_weight_bytes
    assert held is not None
    expected: dict[str, int] = {}
    for param in json.loads((tmp_path / "tvm" / "step.json").read_text())["params"]:
        size = torch.empty(param["shape"], dtype=getattr(torch, param["dtype"])).nbytes
        expected[param["source"]] = expected.get(param["source"], 0) + size
    assert held == expected
    packed = {
        name: quantized.weights[name].numel() * quantized.weights[name].element_size()
        for name in held
        if name.endswith(".qweight")
    }
    assert len(packed) == 2 * 4 + 1
    assert all(held[name] == size for name, size in packed.items()), (held, packed)


def test_engine_batch_invariance_on_tvm(smollm2_o2, smollm2_tvm, check_batch_invariance) -> None:
    check_batch_invariance(smollm2_tvm, smollm2_o2.tokenizer, "tvm")


def test_unlowerable_node_names_the_op_and_model_line(tmp_path: Path, make_tiny_program) -> None:
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    options = PassOptions(quantization="int4", dtype="f16")  # f16 activations into int4: no kernel here
    half, _ = PassManager(pipeline(2, options)).run(program, options)
    with pytest.raises(BackendError, match=r"quantized_linear.*frontend/models/llama\.py:\d+"):
        TVMBackend().compile(half, Target("cpu"), tmp_path / "tvm", CompileSettings())


def test_foreign_cpu_features_are_refused_at_load(tmp_path: Path, tvm_compile, make_tiny_program) -> None:
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    tvm_compile(program, tmp_path / "tvm")
    description = json.loads((tmp_path / "tvm" / "step.json").read_text())
    description["cpu_features"].append("avx9000")
    (tmp_path / "tvm" / "step.json").write_text(json.dumps(description))
    with pytest.raises(BackendError, match="avx9000"):
        TVMBackend().load(tmp_path / "tvm", program.weights, Target("cpu"))


def test_the_host_target_has_amx_exactly_where_linux_grants_it() -> None:
    """A VM reports an older CPU model than it runs (LLVM's name for it lacks AMX): the host target adds
    AMX where the kernel grants the tile data, and removes it where the kernel would not."""
    from kiln.backends.tvm import cpu

    if Target("cpu").machine != "x86_64":
        pytest.skip("AMX is x86-64's")
    target = cpu.llvm_target(Target("cpu"))
    isa = cpu.int_dot_isa(target)
    assert ("amx-int8" in cpu.llvm_features(target)) == enable_amx()
    assert (isa is not None and isa.name == "amx") == enable_amx()


def test_unknown_mcpu_is_refused_before_compiling() -> None:
    refusal = TVMBackend().capabilities(Target("cpu", "nosuchcpu")).unavailable
    assert refusal is not None and "nosuchcpu" in refusal.reason
    assert TVMBackend().capabilities(Target("cpu")).unavailable is None


def test_compile_settings_threads_are_recorded(tmp_path: Path, make_tiny_program) -> None:
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=2)
    code = TVMBackend().compile(program, Target("cpu"), tmp_path / "tvm", CompileSettings(num_threads=1))
    assert code.manifest["num_threads"] == 1
    assert set(code.kernels.values()) <= {"templated", "hand-written TIR", "tuned"}


_RUNTIME_ONLY = """
import json, sys, time
start = time.perf_counter()
from pathlib import Path
from kiln.runtime.artifact import load_artifact, probe_logits
artifact = load_artifact(Path(sys.argv[1]))
loaded = time.perf_counter()
now, recorded = probe_logits(artifact)
libraries = sorted({line.split("/")[-1].strip() for line in open("/proc/self/maps") if "libtvm" in line})
import os
print(json.dumps({"libraries": libraries, "tvm_imported": "tvm" in sys.modules,
                  "error": float(abs(now - recorded).max()), "load_s": loaded - start,
                  "threads": os.environ.get("TVM_NUM_THREADS")}))
"""


@pytest.mark.slow
def test_artifact_runs_with_the_tvm_runtime_only(tmp_path: Path, tiny_hf) -> None:
    import subprocess
    import sys

    from kiln.cli import main

    tiny_hf("qwen2", tmp_path / "hf")
    assert (
        main(["compile", str(tmp_path / "hf"), "--backend", "tvm", "-o", str(tmp_path / "art"), "--quiet"])
        == 0
    )
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    entry = manifest["targets"]["cpu"]
    assert entry["backend"] == "tvm" and entry["code"] == ["step.json", "step.so"]
    assert {"templated", "hand-written TIR"} <= set(entry["kernels"].values())
    env = {name: value for name, value in os.environ.items() if name != "TVM_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", _RUNTIME_ONLY, str(tmp_path / "art")],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "libtvm_runtime.so" in report["libraries"]
    assert "libtvm_compiler.so" not in report["libraries"] and not report["tvm_imported"]
    assert report["error"] == 0.0
    # TVM left alone guesses its thread count from the core topology (one thread on a 2-vCPU VM)
    assert report["threads"] == str(len(os.sched_getaffinity(0)))


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("kernels", ["int_dot", "float"])
def test_quantized_tiny_model_matches_the_reference(
    quantization: str, kernels: str, tmp_path: Path, tvm_compile, make_tiny_program, ragged_run
) -> None:
    """int4 (4-bit, float zero point) and int8 (per channel) through the hand-written kernels, the
    integer-dot ones of this CPU and the float32 ones of a CPU without AVX2: their one-row, row-block
    and many-row paths all run in the ragged steps."""
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    options = PassOptions(quantization=quantization, quantize_lm_head=True)
    quantized, _ = PassManager(pipeline(2, options)).run(program, options)
    assert quantized.graph.op_counts()["quantized_linear"] == 2 * 4 + 1
    if kernels == "int_dot" and "avx2" not in host_flags():
        pytest.skip("this CPU lacks AVX2: its quantized linears are the float32 kernels")
    target = FLOAT_PATH_CPU if kernels == "float" else None
    tvm = tvm_compile(quantized, tmp_path / "tvm", target)
    params = json.loads((tmp_path / "tvm" / "step.json").read_text())["params"]
    int_dot_layouts = [p["transform"] for p in params if p["transform"].startswith("dot_tiled:")]
    assert len(int_dot_layouts) == (0 if kernels == "float" else 2 * 4 + 1), int_dot_layouts
    tolerance = TOLERANCE if kernels == "float" else QUANTIZED_TOLERANCE
    reference = ReferenceExecutable(quantized.graph, quantized.weights)
    ours, theirs = ragged_run([tvm, reference], 99)
    for step in range(2):
        assert _relative_error(ours[step], theirs[step]) < tolerance, (quantization, step)
    decode = build_step_inputs([SequenceSlice([7], 20, [3, 7])], BLOCK_SIZE)
    cache_ours, cache_theirs = ours[2], theirs[2]
    assert (
        _relative_error(
            torch.from_numpy(tvm.step(decode, cache_ours)),
            torch.from_numpy(reference.step(decode, cache_theirs)),
        )
        < tolerance
    )


@pytest.mark.parametrize(
    ("kind", "cache_dtype"),
    [("llama", "fp8_e4m3"), ("gemma3", "fp8_e4m3"), ("llama", "f16"), ("gemma3", "bf16")],
)  # gemma3: sliding-window layers and GQA
def test_a_narrower_kv_cache_matches_the_reference(
    kind: str, cache_dtype: str, tmp_path: Path, tvm_compile, make_tiny_program, ragged_run
) -> None:
    """--kv-cache-dtype f16 / bf16: the kernels round K and V to the cache's dtype and read them back
    as float32, as the reference does (the same rounded values); fp8_e4m3: they store K / scale and
    V / scale as float8 e4m3 and read them back times the scale (the same float8 values, bar ties)."""
    program = make_tiny_program(kind, tmp_path / "hf", opt_level=0)
    options = PassOptions(kv_cache_dtype=cache_dtype)
    narrow, _ = PassManager(pipeline(2, options)).run(program, options)
    tvm = tvm_compile(narrow, tmp_path / "tvm")
    ir_dtype = narrow.graph.input(KV_CACHE_INPUT).type.dtype
    recorded = json.loads((tmp_path / "tvm" / "step.json").read_text())["signature"]
    assert StepSignature.from_fields(recorded).kv_cache.dtype == ir_dtype
    reference = ReferenceExecutable(narrow.graph, narrow.weights)
    ours, theirs = ragged_run([tvm, reference], 5)
    for step in range(2):
        assert _relative_error(ours[step], theirs[step]) < TOLERANCE, (kind, step)
    assert ir_dtype_of(ours[2]) == ir_dtype_of(theirs[2]) == ir_dtype
    ours[2], theirs[2] = as_torch(ours[2]), as_torch(theirs[2])  # the host caches, shared as tensors
    # K and V reach the rounding a float32 ulp or so from the reference's: a few round the other way
    same_bytes = (ours[2].view(torch.uint8) == theirs[2].view(torch.uint8)).float().mean()
    one_step = {"fp8_e4m3": 0.07, "f16": 1e-3, "bf16": 8e-3}[cache_dtype]  # 2^-4, 2^-11, 2^-8 and a margin
    assert same_bytes > 0.999 and _relative_error(ours[2].float(), theirs[2].float()) < one_step
