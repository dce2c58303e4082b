"""What the ONNX lowering builds, for the backends that run it (onnxruntime, tensorrt)."""

from __future__ import annotations

from kiln.backends.base import Capabilities, Hardware, Refusal, integer_dot_refusal
from kiln.backends.targets import Target


def onnx_capabilities(backend: str, target: Target, unavailable: str | None) -> Capabilities:
    """The dtypes `target`'s hardware computes in; a KV cache in the model's dtype only; no collective
    ops (the CPU build has no all-reduce, and cutting the graph at every collective would make two
    sessions a layer with a host round trip between them), 16-bit activations; LoRA but on TensorRT."""
    hardware = Hardware.of(target)
    return Capabilities(
        unavailable=Refusal(unavailable) if unavailable is not None else None,
        dtypes=hardware.dtypes,
        lora=backend != "tensorrt",
        why_not={
            "enable_lora": Refusal(
                f"LoRA adapters run on tvm, onnxruntime and reference, not {backend}: its engines take no "
                "run-time adapter tables",
                "enable_lora",
                hint="use --backend tvm with --enable-lora",
            ),
            **hardware.why_not,
            "kv_cache_dtype": Refusal(
                f"a KV cache in another dtype than the model's (--kv-cache-dtype f16, bf16, fp8) runs on tvm "
                f"and reference, not {backend}",
                "kv_cache_dtype",
                hint="use --backend tvm, or drop --kv-cache-dtype",
            ),
            "tensor_parallel_size": Refusal(
                f"tensor parallelism runs on tvm and reference, not {backend}: its CPU build has no "
                "collective ops to join the ranks",
                "tensor_parallel_size",
                hint="use --backend tvm with --tensor-parallel-size",
            ),
            "activation_bits": integer_dot_refusal(f"backend {backend}"),
        },
    )
