"""compiler.resolve: every `auto` decided in one place, each backend asked what it builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.backends.base import BuildRequest
from kiln.backends.registry import BACKEND_NAMES, get_backend
from kiln.backends.targets import Target, host_gpu_arch
from kiln.compiler import ModelOptions, OptionsError, resolve


def test_auto_picks_tvm_for_this_cpu_and_names_the_reason(smollm2_gguf_path: Path) -> None:
    model = str(smollm2_gguf_path)
    plan = resolve(ModelOptions(model))
    if host_gpu_arch() is None:
        assert (plan.backend, [t.name for t in plan.targets]) == ("tvm", ["cpu"])
        assert "no NVIDIA GPU" in plan.reason
    assert (plan.dtype, plan.kv_cache_dtype, plan.activation_bits, plan.tensor_parallel_size) == (
        "f32",
        None,
        16,
        1,
    )
    assert resolve(ModelOptions(model, backend="reference")).backend == "reference"
    assert [t.name for t in resolve(ModelOptions(model, target="cpu:znver3")).targets] == ["cpu:znver3"]
    assert [t.name for t in resolve(ModelOptions(model, tensor_parallel_size=2)).targets] == ["cpu"]


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
    }
    assert "auto" not in plan.compiled().values()
    pipeline = plan.pipeline(context_len=64)
    assert (pipeline.quantization, pipeline.kv_cache_dtype, pipeline.context_len) == (None, "fp8_e4m3", 64)


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
    assert (refusal is None) == (capabilities.float8_kv_cache and capabilities.unavailable is None)
    if refusal is not None and capabilities.unavailable is None:
        assert refusal.option == "kv_cache_dtype" and refusal.hint
