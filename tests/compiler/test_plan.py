"""compiler.resolve: every `auto` decided in one place, each backend asked what it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.backends.base import BuildRequest
from kiln.backends.registry import BACKEND_NAMES, get_backend
from kiln.backends.targets import Target, host_gpu_arch, host_machine
from kiln.compiler import ModelOptions, OptionsError, resolve


def test_auto_picks_tvm_for_this_cpu_and_names_the_reason(smollm2_gguf_path: Path) -> None:
    model = str(smollm2_gguf_path)
    plan = resolve(ModelOptions(model))
    if host_gpu_arch() is None:
        assert (plan.backend, [t.name for t in plan.targets]) == ("tvm", ["cpu"])
        assert "no NVIDIA GPU" in plan.reason
    assert (plan.dtype, plan.activation_bits, plan.tensor_parallel_size) == ("f32", 16, 1)
    assert plan.kv_cache_dtype == ("f16" if plan.targets[0].kind == "cpu" else None)
    assert resolve(ModelOptions(model, backend="reference")).backend == "reference"
    assert [t.name for t in resolve(ModelOptions(model, target="cpu:znver3")).targets] == ["cpu:znver3"]
    assert [t.name for t in resolve(ModelOptions(model, tensor_parallel_size=2)).targets] == ["cpu"]
    assert plan.lora_dtype is None  # no LoRA
    lora = resolve(ModelOptions(model, enable_lora=True))
    assert lora.lora_dtype == (
        "f16" if lora.targets[0].kind == "cpu" else None
    )  # auto: half the bytes on CPUs
    assert resolve(ModelOptions(model, enable_lora=True, backend="reference")).lora_dtype is None


def test_auto_quantization_keeps_gguf_blocks_and_float_models_float(
    smollm2_gguf_path: Path, tiny_hf_dir: Path
) -> None:
    assert resolve(ModelOptions(str(smollm2_gguf_path))).quantization == "gguf"
    assert resolve(ModelOptions(str(smollm2_gguf_path), quantization="none")).quantization is None
    assert resolve(ModelOptions(str(smollm2_gguf_path), quantization="int4")).quantization == "int4"
    assert resolve(ModelOptions(str(tiny_hf_dir))).quantization is None


def test_the_compiled_options_are_recorded_decided(tiny_hf_dir: Path) -> None:
    plan = resolve(ModelOptions(str(tiny_hf_dir), backend="reference", kv_cache_dtype="fp8"))
    assert plan.compiled() == {
        "backend": "reference",
        "quantization": None,
        "group_size": 32,
        "dtype": "f32",
        "kv_cache_dtype": "fp8_e4m3",
        "activation_bits": 16,
        "opt_level": 2,
        "tensor_parallel_size": 1,
        "enable_lora": False,
        "lora_dtype": None,
    }
    assert "auto" not in plan.compiled().values()
    pipeline = plan.pipeline(context_len=64)
    assert (pipeline.quantization, pipeline.kv_cache_dtype, pipeline.context_len) == (None, "fp8_e4m3", 64)


def test_the_kv_cache_is_float16_for_tvm_cpu_kernels_and_the_float_dtype_elsewhere(
    smollm2_gguf_path: Path,
) -> None:
    model = str(smollm2_gguf_path)

    def kv_cache_dtype(**options: object) -> str | None:
        return resolve(ModelOptions(model, **options)).kv_cache_dtype  # type: ignore[arg-type]

    assert kv_cache_dtype(target="cpu") == "f16"
    assert kv_cache_dtype(target="cpu", kv_cache_dtype="f32") is None  # the float dtype: no cast
    assert kv_cache_dtype(target="cpu", kv_cache_dtype="bf16") == "bf16"
    assert kv_cache_dtype(target="cpu", dtype="f16") is None
    assert kv_cache_dtype(target="cpu", dtype="f16", kv_cache_dtype="f32") == "f32"
    assert kv_cache_dtype(backend="reference") is None
    assert kv_cache_dtype(backend="onnxruntime") is None
    with pytest.raises(OptionsError, match="not onnxruntime") as refused:
        resolve(ModelOptions(model, backend="onnxruntime", kv_cache_dtype="f16"))
    assert refused.value.hint == "use --backend tvm, or drop --kv-cache-dtype"


def test_a_gpu_without_bfloat16_refuses_a_bfloat16_cache_naming_it() -> None:
    from kiln.backends.base import Hardware

    turing = Hardware.of(Target("cuda", "sm_75", "x86_64"))
    assert "bf16" not in turing.kv_cache_dtypes and "f16" in turing.kv_cache_dtypes
    assert "sm_75" in turing.why_not["kv_cache_dtype=bf16"].reason
    assert turing.why_not["kv_cache_dtype=bf16"].hint == "use --kv-cache-dtype f16 for cuda:sm_75"


def test_eight_bit_activations_are_refused_off_the_tvm_cpu_kernels(smollm2_gguf_path: Path) -> None:
    with pytest.raises(OptionsError, match="CPU integer-dot kernels, not backend onnxruntime"):
        resolve(ModelOptions(str(smollm2_gguf_path), backend="onnxruntime", activation_bits=8))


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_every_backend_declares_what_it_builds_for_the_cpu(name: str) -> None:
    capabilities = get_backend(name).capabilities(Target("cpu"))
    plain = BuildRequest(
        quantization=None, dtype="f32", kv_cache_dtype=None, activation_bits=16, tensor_parallel_size=1
    )
    if capabilities.unavailable is None:
        assert capabilities.refusal(plain) is None
    float8 = BuildRequest(None, "f32", "fp8_e4m3", 16, 1)
    refusal = capabilities.refusal(float8)
    assert (refusal is None) == (
        "fp8_e4m3" in capabilities.kv_cache_dtypes and capabilities.unavailable is None
    )
    if refusal is not None and capabilities.unavailable is None:
        assert refusal.option == "kv_cache_dtype" and refusal.hint


@pytest.mark.parametrize(
    ("gpu", "builds", "expected", "reason"),
    [
        (None, True, "cpu", "no NVIDIA GPU here: TVM for this CPU"),
        ("sm_120", True, "cpu", "the GPU is sm_120, not one of sm_70"),
        ("sm_100", True, "cpu", "the GPU is sm_100, not one of sm_70"),
        ("sm_90", False, "cpu", "this host cannot build for its GPU (no nvcc here"),
        ("sm_90", True, "cuda", "the local GPU is sm_90"),
        ("sm_87", True, "cuda", "the local GPU is sm_87"),  # a Jetson's arch; the host code is this machine's
    ],
)
def test_auto_on_each_kind_of_gpu_host(
    smollm2_gguf_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpu: str | None,
    builds: bool,
    expected: str,
    reason: str,
) -> None:
    """`--backend auto` where this host has (simulated) a supported GPU it can build for, one it cannot
    build for, an arch Kiln does not know, or none."""
    from kiln.backends.tvm import cuda
    from kiln.compiler import plan as plan_module

    monkeypatch.setattr(plan_module, "host_gpu_arch", lambda: gpu)
    monkeypatch.setattr(cuda, "unsupported_arch", lambda arch: None if builds else f"no nvcc here for {arch}")
    plan = resolve(ModelOptions(str(smollm2_gguf_path)))
    if expected == "cuda":
        expected = Target("cuda", gpu, host_machine()).name
    assert plan.backend == "tvm" and [t.name for t in plan.targets] == [expected]
    assert reason in plan.reason, plan.reason
    assert plan.kv_cache_dtype == ("f16" if expected == "cpu" else None)
