"""`resolve`: what a request for a model becomes on this host. It decides every `auto` (backend,
targets, quantization, dtypes, activation bits, ranks), asks the chosen backend once per target whether
it builds that, and refuses what it does not, naming the option, before anything loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.backends.base import BuildRequest
from kiln.backends.registry import get_backend
from kiln.backends.targets import CUDA_ARCHS, Target, TargetError, host_gpu_arch, host_machine, parse_targets
from kiln.compiler.options import (
    AUTO,
    DEFAULT_ACTIVATION_BITS,
    DEFAULT_DTYPE,
    ModelOptions,
    OptionsError,
    PipelineOptions,
    compiled_options,
)
from kiln.frontend.load import holds_gguf_blocks
from kiln.passes.base import GGUF_MIXES, pass_quantization

CPU_KV_CACHE_DTYPE = "f16"  # auto's KV cache for TVM on CPUs with float32 activations
CPU_LORA_DTYPE = "f16"  # auto's LoRA tables there


@dataclass(frozen=True)
class Plan:
    """A model to compile: the options as asked, and every choice `auto` left open, made.
    `kv_cache_dtype`: None (the float dtype) or another (passes.base.KV_CACHE_DTYPES); `quantization`:
    None for float weights."""

    options: ModelOptions
    backend: str
    targets: tuple[Target, ...]
    reason: str  # why this backend and these targets, for a person
    quantization: str | None
    dtype: str
    kv_cache_dtype: str | None
    activation_bits: int
    tensor_parallel_size: int
    lora_dtype: str | None = None  # the LoRA tables' dtype, None: the float dtype (or no LoRA)

    @property
    def model(self) -> str:
        return self.options.model

    @property
    def mmproj(self) -> Path | None:
        """A GGUF model's image-encoder file (--mmproj), if one was given."""
        return Path(self.options.mmproj) if self.options.mmproj is not None else None

    @property
    def tuning_logs(self) -> Path | None:
        """--tuning-logs: a folder, "none", or unset for kiln's own (for TVM, the backend that reads them)."""
        logs = self.options.tuning_logs
        if logs == "none" or (logs is None and self.backend != "tvm"):
            return None
        return Path(logs) if logs is not None else default_tuning_logs()

    def compiled(self) -> dict[str, Any]:
        """The compiled options as decided: the manifest's `compile` fields and the cache's key."""
        return {
            name: getattr(self if hasattr(self, name) else self.options, name) for name in compiled_options()
        }

    def pipeline(self, context_len: int | None = None) -> PipelineOptions:
        """What the pass pipeline is asked for (the fields of `compiled` it knows), for sequences of up to
        `context_len` tokens (None: the model's own maximum)."""
        compiled = self.compiled()
        known = {f.name: compiled[f.name] for f in dataclasses.fields(PipelineOptions) if f.name in compiled}
        return PipelineOptions(**known, context_len=context_len)


def default_tuning_logs() -> Path:
    """The tuning logs shipped with kiln (the repo's tuning_logs/, package data in a wheel)."""
    return Path(__file__).resolve().parents[1] / "tuning_logs"


def resolve(options: ModelOptions) -> Plan:
    """The plan for compiling `options.model` (not an artifact folder: see `check_artifact_options`)."""
    world = options.tensor_parallel_size or 1
    backend, targets, reason = _backend_and_targets(options.backend, options.target, world)
    quantization = options.quantization
    if quantization == AUTO:
        quantization = "gguf" if holds_gguf_blocks(options.model) else "none"
    elif quantization in GGUF_MIXES and holds_gguf_blocks(options.model):
        raise OptionsError(
            f"--quantization {quantization} quantizes float weights, and {options.model} holds GGUF blocks "
            "already",
            hint="compile the GGUF as it is (--quantization auto keeps its blocks), or its float checkpoint "
            f"with --quantization {quantization}",
        )
    dtype = DEFAULT_DTYPE if options.dtype == AUTO else options.dtype
    plan = Plan(
        options=options,
        backend=backend,
        targets=targets,
        reason=reason,
        quantization=None if quantization == "none" else quantization,
        dtype=dtype,
        kv_cache_dtype=_kv_cache_dtype(options.kv_cache_dtype, backend, targets, dtype),
        activation_bits=options.activation_bits or DEFAULT_ACTIVATION_BITS,
        tensor_parallel_size=world,
        lora_dtype=_lora_dtype(options, backend, targets, dtype),
    )
    _refuse_what_cannot_build(plan)
    return plan


def _kv_cache_dtype(asked: str, backend: str, targets: tuple[Target, ...], dtype: str) -> str | None:
    """The KV cache's dtype, None where it is the float dtype. auto: float16 for TVM's CPU kernels with
    float32 activations (half the bytes each decoded token reads, as fast, greedy tokens as a float32
    cache: docs/benchmarks.md), else the float dtype."""
    if asked == AUTO:
        on_cpu = backend == "tvm" and all(target.kind == "cpu" for target in targets)
        asked = CPU_KV_CACHE_DTYPE if on_cpu and dtype == "f32" else dtype
    return None if asked == dtype else asked


def _lora_dtype(options: ModelOptions, backend: str, targets: tuple[Target, ...], dtype: str) -> str | None:
    """The LoRA tables' dtype, None where it is the float dtype. auto: float16 for TVM's CPU kernels with
    float32 activations (an adapter's tables are read every step it runs: half the bytes), else the float
    dtype."""
    asked = options.lora_dtype
    if not options.enable_lora:
        return None
    if asked == AUTO:
        on_cpu = backend == "tvm" and all(target.kind == "cpu" for target in targets)
        asked = CPU_LORA_DTYPE if on_cpu and dtype == "f32" else dtype
    return None if asked == dtype else asked


def _backend_and_targets(backend: str, target: str | None, world: int) -> tuple[str, tuple[Target, ...], str]:
    """auto: TVM for the local GPU's sm_XX where this host can build for it, else TVM for this CPU (CPU
    ranks for tensor parallelism); the reference backend only when asked for."""
    if target is None and world > 1:
        target = "cpu"
    if target is not None:
        try:
            targets = tuple(parse_targets(target))
        except TargetError as error:
            raise OptionsError(str(error), hint=error.hint) from None
        if backend == AUTO:
            return "tvm", targets, f"--target {target}"
        return backend, targets, f"--backend {backend} --target {target}"
    cpu = (Target("cpu"),)
    if backend != AUTO:
        return backend, cpu, f"--backend {backend}"
    arch = host_gpu_arch()
    if arch is None:
        return "tvm", cpu, "no NVIDIA GPU here: TVM for this CPU"
    if arch not in CUDA_ARCHS:
        return "tvm", cpu, f"the GPU is {arch}, not one of {', '.join(CUDA_ARCHS)}: TVM CPU"
    gpu = Target("cuda", arch, host_machine())
    unavailable = get_backend("tvm").capabilities(gpu).unavailable
    if unavailable is not None:
        return "tvm", cpu, f"this host cannot build for its GPU ({unavailable.reason}): TVM CPU"
    return "tvm", (gpu,), f"the local GPU is {arch}"


def _refuse_what_cannot_build(plan: Plan) -> None:
    compiled = plan.compiled()
    request = BuildRequest(
        **{
            f.name: compiled.get(f.name, getattr(plan, f.name, None))
            for f in dataclasses.fields(BuildRequest)
        }
    )
    request = dataclasses.replace(request, quantization=pass_quantization(request.quantization))
    backend = get_backend(plan.backend)
    for target in plan.targets:
        refusal = backend.capabilities(target).refusal(request)
        if refusal is not None:
            raise OptionsError(refusal.reason, hint=refusal.hint)


def compile_stages(targets: tuple[Target, ...]) -> list[str]:
    """The stage names compiler.codegen.compile_model reports to its progress callback, in order (here, not
    there: a display of a compile in a child process needs them without the compiler)."""
    return ["load", "capture", "passes", *(f"codegen {t.name}" for t in targets), "write weights", "write"]
