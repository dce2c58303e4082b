"""What every backend's executable offers the runtime: the step, and the shape of its KV cache."""

from __future__ import annotations

import functools
import math
import mmap
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from kiln.backends.targets import FLOAT8_HINT, Target, bfloat16_refusal, float8_kv_cache_refusal
from kiln.errors import KilnError
from kiln.ir.host_arrays import HOST_DTYPES, device_of
from kiln.ir.step import EMBED, KV_CACHE_INPUT, Logits, StepInputs, StepSignature

if TYPE_CHECKING:
    import torch

    from kiln.backends.lora_tables import LoRASpec
    from kiln.ir import Graph, Program
    from kiln.ir.types import TensorType

KVCache = Any  # a numpy array on the host (KVCacheSpec.allocate), a torch tensor on a GPU


class BackendError(KilnError):
    """A backend cannot compile, load or run what it was given."""


class DeviceRequiredError(BackendError):
    """A build step needs hardware this machine lacks (e.g. a TensorRT engine needs a GPU of the target's
    arch). Whatever the backend could do without it (files in `written`) is kept; the CLI exits 2."""

    def __init__(self, message: str, *, written: list[str] | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.written = written or []


QUANTIZATIONS: tuple[str | None, ...] = (None, "int8", "int4", "gguf")  # None: float weights
FLOAT8_KV_CACHE = "fp8_e4m3"


@dataclass(frozen=True)
class BuildRequest:
    """What a plan asks one backend to build for one target, every choice made. `kv_cache_dtype`: None
    (the float dtype) or one of kiln.passes.base.KV_CACHE_DTYPES."""

    quantization: str | None
    dtype: str
    kv_cache_dtype: str | None
    activation_bits: int
    tensor_parallel_size: int
    enable_lora: bool = False


@dataclass(frozen=True)
class Refusal:
    """Why a backend cannot build something: `option` is the keyword of the option that asked for it
    (`kv_cache_dtype`; the CLI flag is `--kv-cache-dtype`), None where the target itself is the cause."""

    reason: str
    option: str | None = None
    hint: str | None = None


@dataclass(frozen=True)
class Capabilities:
    """What one backend builds for one target, as data. A request outside it is refused with the reason
    the backend gives for that option and value in `why_not` ("kv_cache_dtype=bf16"), else for that option
    ("kv_cache_dtype"); `unavailable`: the target cannot be built here at all."""

    unavailable: Refusal | None = None
    quantizations: frozenset[str | None] = frozenset(QUANTIZATIONS)
    dtypes: frozenset[str] = frozenset({"f32", "f16", "bf16"})
    kv_cache_dtypes: frozenset[str | None] = frozenset({None})  # None: the model's float dtype
    activation_bits: frozenset[int] = frozenset({16})
    tensor_parallel: bool = False
    lora: bool = True  # compiles the lora op (LoRA adapters as run-time data)
    why_not: Mapping[str, Refusal] = field(default_factory=dict)

    def refusal(self, request: BuildRequest) -> Refusal | None:
        """The first thing of `request` outside these capabilities, None where all of it builds."""
        if self.unavailable is not None:
            return self.unavailable
        builds = {
            "quantization": request.quantization in self.quantizations,
            "dtype": request.dtype in self.dtypes,
            "kv_cache_dtype": request.kv_cache_dtype in self.kv_cache_dtypes,
            "activation_bits": request.activation_bits in self.activation_bits,
            "tensor_parallel_size": request.tensor_parallel_size == 1 or self.tensor_parallel,
            "enable_lora": not request.enable_lora or self.lora,
        }
        for option, supported in builds.items():
            if not supported:
                value = getattr(request, option)
                return (
                    self.why_not.get(f"{option}={value}")
                    or self.why_not.get(option)
                    or Refusal(f"{option} {value} is not supported", option)
                )
        return None


@dataclass(frozen=True)
class Hardware:
    """What a target's hardware computes in, whatever the backend (bfloat16 from sm_80, float8
    conversions from sm_89; CPUs convert in software), with why not the rest."""

    dtypes: frozenset[str]
    kv_cache_dtypes: frozenset[str | None]
    why_not: dict[str, Refusal]

    @classmethod
    def of(cls, target: Target) -> Hardware:
        why_not = {}
        bfloat16 = bfloat16_refusal(target)
        if bfloat16 is not None:
            why_not["dtype"] = Refusal(bfloat16, "dtype", hint=f"use --dtype f16 for {target.name}")
            why_not["kv_cache_dtype=bf16"] = Refusal(
                bfloat16, "kv_cache_dtype", hint=f"use --kv-cache-dtype f16 for {target.name}"
            )
        float8 = float8_kv_cache_refusal(target)
        if float8 is not None:
            why_not[f"kv_cache_dtype={FLOAT8_KV_CACHE}"] = Refusal(float8, "kv_cache_dtype", hint=FLOAT8_HINT)
        dtypes = frozenset({"f32", "f16"} if bfloat16 is not None else {"f32", "f16", "bf16"})
        kv_cache_dtypes = frozenset({None, *dtypes} | ({FLOAT8_KV_CACHE} if float8 is None else set()))
        return cls(dtypes, kv_cache_dtypes, why_not)


def integer_dot_refusal(where: str) -> Refusal:
    """8-bit activations are a choice of the TVM backend's CPU integer-dot kernels; `where` is the
    backend or target that has none."""
    return Refusal(
        f"--activation-bits 8 applies to the TVM backend's CPU integer-dot kernels, not {where}",
        "activation_bits",
        hint="compile with --backend tvm for cpu targets, or drop --activation-bits",
    )


@dataclass(frozen=True)
class CompileSettings:
    """What a compiling backend may need beyond the program and the target."""

    max_num_seqs: int = 16
    max_model_len: int = 2048
    tuning_logs: Path | None = None  # the repo's tuning_logs/ (or another) folder; None: no tuning logs
    num_threads: int | None = None  # CPU threads recorded for the runtime; None: all cores
    activation_bits: int = 16  # CPU integer-dot kernels: 16 (default) or 8 (llama.cpp's rounding)


@dataclass(frozen=True)
class StoredWeight:
    """A weight as compiled code reads it: the program's weight `source` laid out by `lay_out` (for the
    kernels), stored in the artifact under `name` so that loading maps it as it is."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    lay_out: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class CompiledCode:
    """What `Backend.compile` wrote: the files (relative to its folder), where each kernel's schedule came
    from (name → "tuned" | "templated" | "default" | ...), backend fields for the manifest, and the
    weights it reads (None: the program's weights as they are)."""

    files: list[str]
    kernels: dict[str, str] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    weights: list[StoredWeight] | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the IR dtype name: f32, f16, bf16, f8e4m3

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * self.element_size

    def allocate(self, num_blocks: int, block_size: int, device: str = "cpu") -> KVCache:
        """Zeros. On the host a numpy array over an anonymous mapping (page-aligned, untouched zero
        pages), so a block costs resident memory only once it is written, in 4 KiB pages; on a GPU a
        torch tensor."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        if str(device).split(":")[0] != "cpu":
            import torch

            from kiln.ir.types import DTYPES

            return torch.zeros(shape, dtype=DTYPES[self.dtype], device=device)
        pages = mmap.mmap(-1, math.prod(shape) * self.element_size)
        return np.frombuffer(pages, HOST_DTYPES[self.dtype]).reshape(shape)

    @property
    def element_size(self) -> int:
        return np.dtype(HOST_DTYPES[self.dtype]).itemsize

    @classmethod
    def of_graph(cls, graph: Graph) -> KVCacheSpec:
        return cls.of_type(graph.input(KV_CACHE_INPUT).type)

    @classmethod
    def of_type(cls, cache: TensorType) -> KVCacheSpec:
        """The spec of a kv_cache input's type (ir/step.py kv_cache_type)."""
        layers, _, _, _, kv_heads, head_dim = cache.shape
        if not all(isinstance(d, int) for d in (layers, kv_heads, head_dim)):
            raise BackendError(f"kv_cache input {cache.text()} must have fixed layers, kv heads and head dim")
        return cls(int(layers), int(kv_heads), int(head_dim), cache.dtype)


Hidden = npt.NDArray[np.float32]  # [rows, hidden] on the host: what `embed` returns


class Executable:
    """A loaded model, what every backend's executable is: `step` runs one ragged batch, writing K/V into
    `kv_cache` in place; `signature` says what it takes (its optional inputs: a step given fewer has them
    filled by `ir.step.fill_absent`) and which entry points it has (`embed` where it can embed). A GPU
    executable names where its cache must live (`kv_cache_device`, e.g. "cuda"). The defaults here are a
    host executable's that keeps nothing of a cache between steps and holds its weights as stored."""

    signature: StepSignature
    kv_cache_device: str = "cpu"
    sleeps: bool = True  # its KV cache and weights can be handed back (runtime/live_weights.py)

    @functools.cached_property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec.of_type(self.signature.kv_cache)

    @property
    def embeds(self) -> bool:
        return self.signature.has(EMBED)

    @functools.cached_property
    def lora_spec(self) -> LoRASpec | None:
        """The LoRA tables its step takes, None for a step compiled without."""
        from kiln.backends.lora_tables import LoRASpec

        return LoRASpec.of_signature(self.signature)

    @property
    def embedding_size(self) -> int:
        """The width of `embed`'s rows (the model's hidden size); 0 without `embed`."""
        return self.signature.embedding_size or 0

    @property
    def held_weight_bytes(self) -> dict[str, int] | None:
        """The bytes of each weight (by its name in the artifact's weights) as the compiled code holds it,
        after its layouts (packed planes, factored scales); None where they are as in the artifact."""
        return None

    def step(self, inputs: StepInputs, kv_cache: KVCache) -> Logits:
        """Logits [L, vocab] (a row per `inputs.logits_indices`), float32, on the host."""
        raise NotImplementedError

    def embed(self, inputs: StepInputs, kv_cache: KVCache) -> Hidden:
        """The final hidden states [L, hidden] (after the last norm) of the `logits_indices` rows, float32,
        on the host; K/V written as `step` writes them. Only where `embeds`."""
        raise BackendError(
            "this model cannot embed: its artifact has no `embed` function (the ONNX Runtime and "
            "TensorRT backends, tensor parallelism, and artifacts compiled before kiln had one lack it)"
        )

    def release_kv_cache(self) -> None:
        """Drop what it keeps of the last KV cache it stepped with (TVM keeps the cache's view), so that
        the engine can free the cache."""

    def close(self) -> None:
        """Let go of what it holds beyond memory (worker processes)."""


class ImageEncoder(Protocol):
    """A loaded image encoder (a vision-language model's second entry point, `encode_image`)."""

    def encode(self, inputs: Mapping[str, npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
        """The encoder's output rows [rows, hidden] for one image's inputs (by name; rows padded to a
        multiple of 4)."""
        ...


def allocate_kv_cache(executable: Executable, num_blocks: int, block_size: int) -> KVCache:
    """A zeroed KV cache of `num_blocks` blocks for `executable`, where it reads it."""
    return executable.kv_cache_spec.allocate(num_blocks, block_size, executable.kv_cache_device)


def check_kv_cache_device(kv_cache: KVCache, device: str) -> None:
    """Refuse a cache that is not where the executable reads it (there are no copies behind it)."""
    if device_of(kv_cache) != device:
        raise BackendError(
            f"the KV cache is on {device_of(kv_cache)}; this executable reads it on {device}",
            hint="allocate it with kiln.backends.base.allocate_kv_cache (or kv_cache_spec.allocate(..., "
            "device=executable.kv_cache_device))",
        )


class Backend(Protocol):
    """Turns a program into files for one target, and those files back into an Executable."""

    name: str
    copies_weights: bool  # its executables copy the weights they are given (the mapped file's pages can go)

    def version(self) -> str:
        """What must match between compile and load (the backend's own version string)."""
        ...

    def capabilities(self, target: Target) -> Capabilities:
        """What this backend builds for `target` on this machine, and why not the rest."""
        ...

    def compile(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        """Write the compiled code for `target` into `folder`."""
        ...

    def load(self, folder: Path, weights: dict[str, torch.Tensor], target: Target) -> Executable: ...

    def stored_weights(self, folder: Path) -> list[StoredWeight] | None:
        """The weights the compiled code in `folder` reads, as `compile` returned them (None: the
        program's weights as they are); new weights are laid out by it (kiln/compiler/refit.py)."""
        ...

    def check_structure(self, folder: Path, target: Target) -> list[str]:
        """Checks of the compiled files that need no device (e.g. the .so carries code for the arch):
        one line per check passed; raise BackendError on a failed one."""
        ...

    def compile_encoder(
        self, program: Program, target: Target, folder: Path, settings: CompileSettings
    ) -> CompiledCode:
        """Write a vision-language model's image encoder for `target` into `folder`; the files written."""
        ...

    def load_encoder(
        self, folder: Path, weights: dict[str, torch.Tensor], target: Target
    ) -> ImageEncoder: ...


def leave_cores_to_compiled_code() -> None:
    """Called when a compiled CPU executable loads: torch, where this process has it, runs one thread.

    torch's OpenMP pool spin-waits after each parallel op on the cores the backend's worker threads
    need: when the runtime's host work was torch's, SmolLM2's decode on TVM went from 87 to 185 tok/s on
    2 cores with one torch thread. The runtime's host work is numpy now; a torch-based backend (the
    reference, ONNX Runtime's weight bindings) or the compiler in the same process still imports it.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
