"""CUDA targets of the TVM backend, cross-compiled on a machine without a GPU: the compiled step.so carries
a cubin for its own arch (and no other), `kiln verify` checks the structure and says it did not run,
loading on a machine whose GPU differs is refused. Running the code needs a GPU (the `gpu` test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kiln.backends.base import BackendError, CompileSettings, KVCacheSpec
from kiln.backends.gpu_requirements import TORCH_CUDA, TVM_CUDA, missing_for_gpu
from kiln.backends.targets import Target, host_gpu_arch
from kiln.backends.tvm import cuda
from kiln.ir import Program
from kiln.ir.step import StepSignature
from kiln.passes import PassManager, PassOptions, pipeline


def _has_nvcc() -> bool:
    try:
        cuda.find_nvcc()
    except BackendError:
        return False
    return True


needs_nvcc = pytest.mark.skipif(not _has_nvcc(), reason="CUDA targets need nvcc (the CUDA toolkit)")


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory, tiny_llama_program: Program) -> dict[str, tuple[Path, object]]:
    program = tiny_llama_program
    builds = {}
    for arch in ("sm_87", "sm_90"):
        folder = tmp_path_factory.mktemp("tiny") / arch
        builds[arch] = (folder, cuda.compile_cuda(program, Target("cuda", arch), folder, CompileSettings()))
    return builds


@needs_nvcc
@pytest.mark.parametrize("arch,other", [("sm_87", "sm_90"), ("sm_90", "sm_87")])
def test_step_so_carries_a_cubin_for_its_arch_only(tiny_builds, arch: str, other: str) -> None:
    folder, _ = tiny_builds[arch]
    library = folder / cuda.LIBRARY
    lines = cuda.check_cuda_library(library, Target("cuda", arch))
    assert lines[0].startswith(f"step.so carries a cubin for {arch}")
    assert any(f"PTX for compute_{arch[3:]}" in line for line in lines)
    entries = cuda.fatbin_entries(library.read_bytes())
    assert {(e.kind, e.arch) for e in entries} == {("cubin", arch), ("ptx", arch)}
    with pytest.raises(BackendError, match=f"no cubin for {other}.*cubins for {arch}"):
        cuda.check_cuda_library(library, Target("cuda", other))


@needs_nvcc
@pytest.mark.parametrize("quantization,dtype", [("int4", "f32"), ("int8", "f32"), ("int4", "f16")])
def test_quantized_models_compile_for_ampere_and_hopper(
    quantization: str, dtype: str, tmp_path: Path, make_tiny_program
) -> None:
    program = make_tiny_program("llama", tmp_path / "hf")
    options = PassOptions(quantization=quantization, dtype=dtype)
    quantized = PassManager(pipeline(2, options)).run(program, options)[0]
    assert any(node.op == "quantized_linear" for node in quantized.graph.nodes)
    for arch in ("sm_80", "sm_90"):
        folder = tmp_path / arch
        code = cuda.compile_cuda(quantized, Target("cuda", arch), folder, CompileSettings())
        lines = cuda.check_cuda_library(folder / cuda.LIBRARY, Target("cuda", arch))
        assert lines[0].startswith(f"step.so carries a cubin for {arch}"), lines
        step = {name: origin for name, origin in code.kernels.items() if name.startswith("qlinear_")}
        decode = {name: origin for name, origin in step.items() if name.startswith("qlinear_decode")}
        assert decode and set(decode.values()) == {"templated (GPU split-K)"}, code.kernels
        assert set(step.values()) - set(decode.values()) == {"templated (GPU tiled GEMM)"}, code.kernels


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_70", "sm_72", "sm_75"])
def test_older_gpus_compile_in_float16_with_quantized_linears(
    arch: str, tmp_path: Path, make_tiny_program
) -> None:
    compiler = cuda.device_compiler(arch)
    if compiler is None:
        pytest.skip(str(cuda.unsupported_arch(arch)))
    program = make_tiny_program("llama", tmp_path / "hf")
    options = PassOptions(quantization="int4", dtype="f16")
    quantized = PassManager(pipeline(2, options)).run(program, options)[0]
    target = Target.parse(f"cuda:{arch}")
    cuda.compile_cuda(quantized, target, tmp_path / arch, CompileSettings())
    lines = cuda.check_cuda_library(tmp_path / arch / cuda.LIBRARY, target)
    assert lines[0].startswith(f"step.so carries a cubin for {arch}"), lines
    description = json.loads((tmp_path / arch / cuda.DESCRIPTION).read_text())
    assert description["host_triple"] == target.triple  # sm_72: Xavier, aarch64
    assert description["device_code"]["nvcc"][0] == ("nvrtc12" if compiler == "nvrtc12" else "-gencode")


# the tiny transformers models (tests/backends/conftest.py) beyond Llama's
NEW_FAMILIES = ["qwen3", "gemma3", "phi3", "mixtral", "qwen3_moe", "olmoe"]


@needs_nvcc
@pytest.mark.parametrize(  # each family once, Jetson Orin (an aarch64 host) and Hopper in turn
    "kind,arch", [(kind, ("sm_87", "sm_90")[i % 2]) for i, kind in enumerate(NEW_FAMILIES)]
)
def test_each_family_cross_compiles_for_jetson_orin_or_hopper(
    kind: str, arch: str, tmp_path: Path, make_tiny_program
) -> None:
    program = make_tiny_program(kind, tmp_path / "hf", opt_level=2)
    cuda.compile_cuda(program, Target("cuda", arch), tmp_path / arch, CompileSettings())
    lines = cuda.check_cuda_library(tmp_path / arch / cuda.LIBRARY, Target("cuda", arch))
    assert lines[0].startswith(f"step.so carries a cubin for {arch}"), (kind, lines)


@needs_nvcc
def test_step_json_and_kernel_origins(tiny_builds) -> None:
    folder, code = tiny_builds["sm_90"]
    description = json.loads((folder / cuda.DESCRIPTION).read_text())
    assert description["device"] == "cuda" and description["gpu_arch"] == "sm_90"
    signature = StepSignature.from_fields(description["signature"])
    assert KVCacheSpec.of_type(signature.kv_cache) == KVCacheSpec(2, 2, 8, "f32")
    assert signature.entry_points == ("step", "decode", "embed")
    assert description["params"]
    origins = code.kernels
    assert {origins[k] for k in origins if k.startswith(("attention", "kv_write"))} == {"hand-written TIR"}
    assert description["embed_params"] > 0
    linears = {k: origins[k] for k in origins if k.startswith("linear")}
    decode = {v for k, v in linears.items() if k.startswith("linear_decode")}
    step = {v for k, v in linears.items() if not k.startswith("linear_decode")}
    assert decode == {"templated (GPU split-K)"} and step == {"templated (GPU tiled GEMM)"}
    assert code.manifest["gpu_arch"] == "sm_90" and code.files == [cuda.LIBRARY, cuda.DESCRIPTION]


def test_a_library_without_device_code_is_refused(tmp_path: Path) -> None:
    library = tmp_path / "step.so"
    library.write_bytes(b"\x7fELF" + bytes(60) + b'extern "C" __global__ void k() {}')
    with pytest.raises(BackendError, match=r"no cubin for sm_90.*CUDA source only"):
        cuda.check_cuda_library(library, Target("cuda", "sm_90"))


def test_gpu_attention_kernels_lower_for_gqa_window_and_f16() -> None:
    """CUDA codegen (no nvcc, no GPU) of the attention variants the SmolLM2 build does not cover."""
    import tvm

    from kiln.backends.tvm.kernels import attention_cuda

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    module = tvm.IRModule(
        {
            "attention": attention_cuda.attention_kernel(8, 2, 128, 0.088, 64, "float16"),
            "kv_write": attention_cuda.kv_write_kernel(2, 128, "float16"),
        }
    )
    with target:
        built = tvm.tirx.build(module, target=target)
    source = built.imports[0].inspect_source("cuda")
    threads = {name: int(count) for count, name in re.findall(r"__launch_bounds__\((\d+)\) (\w+)\(", source)}
    assert threads["attention_kernel"] == attention_cuda.attention_threads(128)
    assert set(threads) == {"attention_kernel", "kv_write_kernel"}
    for kernel in threads:  # float16 in and out: the cache, queries and outputs are half pointers
        assert re.search(kernel + r"\(half\* __restrict__ cache_ptr", source), kernel
    sizes = {"float": 4, "half": 2, "int": 4}
    shared = sum(
        sizes[dtype] * int(count) for dtype, count in re.findall(r"__shared__ \S+ (\w+) \w+\[(\d+)\]", source)
    )
    assert 0 < shared <= 48 * 1024  # the static shared memory every arch allows without opting in


def test_a_gpu_of_another_arch_is_refused_naming_both(monkeypatch) -> None:
    from kiln.backends import targets
    from kiln.runtime.artifact import ArtifactError, choose_target

    manifest = {"targets": {"cuda:sm_87@x86_64": {}, "cuda:sm_90": {}}}
    monkeypatch.setattr(targets, "host_gpu_arch", lambda: "sm_86")
    with pytest.raises(ArtifactError, match=r"sm_87.*sm_86.*sm_90.*sm_86"):
        choose_target(manifest, None)
    monkeypatch.setattr(targets, "host_machine", lambda: "x86_64")
    with pytest.raises(ArtifactError, match=r"for aarch64-unknown-linux-gnu \(target cuda:sm_87\)"):
        choose_target({"targets": {"cuda:sm_87": {}}}, None)  # Orin's host code is aarch64
    monkeypatch.setattr(targets, "host_gpu_arch", lambda: "sm_90")
    assert choose_target(manifest, None) == Target("cuda", "sm_90")


# --- SmolLM2 through the CLI (one compile, both archs) -----------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cuda(tmp_path_factory, smollm2_gguf_path: Path) -> Path:
    from kiln.cli import main

    out = tmp_path_factory.mktemp("cuda") / "smollm2"
    code = main(
        [
            "compile",
            "smollm2-135m-instruct",
            "--backend",
            "tvm",
            "--target",
            "cuda:sm_87,cuda:sm_90",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    return out


@needs_nvcc
@pytest.mark.slow
def test_smollm2_compiles_for_two_archs(smollm2_cuda: Path) -> None:
    manifest = json.loads((smollm2_cuda / "manifest.json").read_text())
    for arch, other in (("sm_87", "sm_90"), ("sm_90", "sm_87")):
        entry = manifest["targets"][f"cuda:{arch}"]
        assert entry["gpu_arch"] == arch and entry["probe"]["logits_file"] is None  # could not run here
        library = smollm2_cuda / f"cuda-{arch}" / "step.so"
        archs = {e.arch for e in cuda.fatbin_entries(library.read_bytes()) if e.kind == "cubin"}
        assert archs == {arch}, f"{library} carries cubins for {archs}, expected only {arch} (not {other})"


@needs_nvcc
@pytest.mark.slow
def test_verify_checks_structure_and_says_it_did_not_run(smollm2_cuda: Path, capsys) -> None:
    from kiln.cli import main

    if host_gpu_arch() is not None:
        pytest.skip("this machine has a GPU: verify runs the probe here")
    assert main(["verify", str(smollm2_cuda)]) == 0
    out = capsys.readouterr().out
    assert "cuda:sm_87: step.so carries a cubin for sm_87" in out
    assert "cuda:sm_90: step.so carries a cubin for sm_90" in out
    assert "did NOT run the probe" in out and "no NVIDIA GPU" in out


@needs_nvcc
@pytest.mark.slow
def test_loading_on_another_gpu_is_refused(smollm2_cuda: Path, monkeypatch) -> None:
    from kiln.backends import targets
    from kiln.runtime.artifact import ArtifactError, load_artifact

    monkeypatch.setattr(targets, "host_gpu_arch", lambda: "sm_80")
    with pytest.raises(
        ArtifactError, match=r"aarch64-unknown-linux-gnu.*for sm_90 but this machine's GPU is sm_80"
    ):
        load_artifact(smollm2_cuda)


CUDA_MISSING = missing_for_gpu(TORCH_CUDA, TVM_CUDA, archs=("sm_87", "sm_90"))


@needs_nvcc
@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(CUDA_MISSING is not None, reason=CUDA_MISSING or "")
def test_smollm2_cuda_logits_match_the_reference(smollm2_cuda: Path, smollm2_o2) -> None:
    from kiln.ir.step import SequenceSlice, build_step_inputs
    from kiln.runtime.artifact import load_artifact

    artifact = load_artifact(smollm2_cuda)
    token_ids = artifact.tokenizer.encode("The capital of France is")
    blocks = [1, 2]
    inputs = build_step_inputs([SequenceSlice(token_ids, 0, blocks)], 16)
    cache = artifact.executable.kv_cache_spec.allocate(4, 16, device="cuda")
    logits = artifact.executable.step(inputs, cache)
    reference_cache = smollm2_o2.executable.kv_cache_spec.allocate(4, 16)
    expected = smollm2_o2.executable.step(inputs, reference_cache)
    error = float(np.abs(logits - expected).max() / np.abs(expected).max())
    assert error < 1e-3, f"CUDA logits differ from the reference by {error:.3g}"
    for step in range(2):  # decode: the first is captured as a CUDA graph, the second replays it
        decode = build_step_inputs([SequenceSlice([42 + step], len(token_ids) + step, blocks)], 16)
        assert np.isfinite(artifact.executable.step(decode, cache)).all()
    assert artifact.executable.graphs is not None, "the CUDA build runs without CUDA graphs"
    artifact.executable.graphs.require(1)  # a capture that failed would have run plain calls


def test_gpu_attention_kernels_take_a_float8_cache_with_runtime_scales() -> None:
    """CUDA codegen of the float8 variants: the cache is __nv_fp8_e4m3, the scales are arguments (one
    kernel serves every layer), activations stay float16."""
    import tvm

    from kiln.backends.tvm.kernels import attention_cuda

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    fp8 = "float8_e4m3fn"
    module = tvm.IRModule(
        {
            "attention": attention_cuda.attention_kernel(8, 2, 128, 0.088, None, "float16", fp8),
            "kv_write": attention_cuda.kv_write_kernel(2, 128, "float16", fp8),
        }
    )
    with target:
        source = tvm.tirx.build(module, target=target).imports[0].inspect_source("cuda")
    for kernel in ("attention_kernel", "kv_write_kernel"):
        signature = re.search(kernel + r"\(([^)]*)\)", source)
        assert signature is not None, kernel
        assert "__nv_fp8_e4m3* __restrict__ cache_ptr" in signature.group(1)
        assert "float k_scale" in signature.group(1) and "float v_scale" in signature.group(1)
        assert "half* __restrict__" in signature.group(1)


@needs_nvcc
def test_a_float8_kv_cache_compiles_for_hopper_and_is_refused_before_ada(
    tmp_path: Path, make_tiny_program
) -> None:
    program = make_tiny_program("llama", tmp_path / "hf", opt_level=0)
    options = PassOptions(dtype="f16", kv_cache_dtype="fp8_e4m3")
    fp8 = PassManager(pipeline(2, options)).run(program, options)[0]
    cuda.compile_cuda(fp8, Target("cuda", "sm_90"), tmp_path / "sm_90", CompileSettings())
    description = json.loads((tmp_path / "sm_90" / cuda.DESCRIPTION).read_text())
    assert StepSignature.from_fields(description["signature"]).kv_cache.dtype == "f8e4m3"
    lines = cuda.check_cuda_library(tmp_path / "sm_90" / cuda.LIBRARY, Target("cuda", "sm_90"))
    assert lines[0].startswith("step.so carries a cubin for sm_90"), lines
    with pytest.raises(BackendError, match=r"float8 KV cache needs .* cuda:sm_87 has none"):
        cuda.compile_cuda(fp8, Target("cuda", "sm_87"), tmp_path / "sm_87", CompileSettings())
    assert not (tmp_path / "sm_87").exists()
