"""What a pass is: a named function `(program, options) -> (program, changed)`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.ir import Program
    from kiln.ir.gguf_blocks import QuantizedTensor

QUANTIZATIONS = ("int8", "int4", "gguf")
# llama.cpp's quantization mixes from float weights: blocks as llama-quantize writes them (passes/quantize/
# gguf_mix.py, gguf_encode.py), then imported as a GGUF's own blocks are (the "gguf" quantization)
GGUF_MIXES = ("q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0")
DTYPES = ("f32", "f16", "bf16")
# --kv-cache-dtype → the cache input's IR dtype (None, beside these: the model's float dtype)
KV_CACHE_STORAGE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "fp8_e4m3": "f8e4m3"}
KV_CACHE_DTYPES = tuple(KV_CACHE_STORAGE)


def pass_quantization(quantization: str | None) -> str | None:
    """The passes' quantization for a compile's: a llama.cpp mix is the gguf import of the blocks it makes."""
    return "gguf" if quantization in GGUF_MIXES else quantization


class PassError(KilnError):
    """A pass failed or was asked for something the program cannot take."""


@dataclass(frozen=True)
class PassOptions:
    """Settings every pass may read.

    quantization: None, "int8" (per output channel, symmetric), "int4" (groups of `group_size`, with
    zero point) or "gguf" (import the GGUF blocks in `gguf_blocks` without re-quantizing).
    gguf_blocks: param name → its GGUF blocks (ir/gguf_blocks.py), read when imported.
    quantize_lm_head: also quantize the LM head (int8 and int4 never quantize the embedding, a gather;
    gguf gathers from the table's blocks when the program is float32).
    kv_cache_dtype: None (the model's float dtype), "f32", "f16", "bf16" or "fp8_e4m3" (kv_cache.py).
    lora: the step takes LoRA adapters (passes/lora.py).
    """

    quantization: str | None = None
    group_size: int = 32
    quantize_lm_head: bool = False
    dtype: str = "f32"
    kv_cache_dtype: str | None = None
    lora: bool = False  # LoRA adapters as run-time data (passes/lora.py)
    lora_dtype: str | None = None  # their tables' dtype (None: the activations')
    gguf_blocks: dict[str, QuantizedTensor] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.quantization not in (None, *QUANTIZATIONS):
            raise PassError(
                f"unknown quantization {self.quantization!r}",
                hint=f"choose one of {', '.join(QUANTIZATIONS)}",
            )
        if self.group_size not in (32, 64, 128):
            raise PassError(f"group_size {self.group_size} is not supported", hint="choose 32, 64 or 128")
        if self.dtype not in DTYPES:
            raise PassError(f"unknown dtype {self.dtype!r}", hint=f"choose one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PassError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}",
                hint="choose f32, f16, bf16 or fp8_e4m3, or None for the model's float dtype",
            )


PassFn = Callable[["Program", PassOptions], tuple["Program", bool]]


@dataclass(frozen=True)
class Pass:
    name: str
    run: PassFn
    doc: str = ""


def fixed_point(name: str, passes: list[Pass], max_rounds: int = 10) -> Pass:
    """One pass that reruns `passes` in order until none changes the program."""

    def run(program: Program, options: PassOptions) -> tuple[Program, bool]:
        changed_any = False
        for _ in range(max_rounds):
            changed_round = False
            for current in passes:
                program, changed = current.run(program, options)
                changed_round |= changed
            changed_any |= changed_round
            if not changed_round:
                return program, changed_any
        raise PassError(f"{name} did not reach a fixed point in {max_rounds} rounds")

    return Pass(name, run, f"until nothing changes: {', '.join(p.name for p in passes)}")
