"""The pipelines, one explicit list per optimisation level: the single source of truth for pass order.

O0: nothing. O1: cleanup. O2: cleanup, fusions, cleanup. Quantization (by option) runs first, so
GGUF blocks are found under the weights' original names and fusions see quantized linears; LoRA (by
option) next, so its ops follow the linears of each module before they fuse; the dtype
conversion (by option) runs next to last, then the float8 KV cache (by option), calibrated on the
program as it will run.
"""

from __future__ import annotations

from kiln.passes.base import Pass, PassError, PassOptions, fixed_point
from kiln.passes.cleanup.canonicalize import CANONICALIZE
from kiln.passes.cleanup.cse import CSE
from kiln.passes.cleanup.dce import DCE
from kiln.passes.cleanup.fold_constants import FOLD_CONSTANTS
from kiln.passes.dtype import CONVERT_DTYPE
from kiln.passes.fusion.add_rms_norm import FUSE_ADD_RMS_NORM
from kiln.passes.fusion.logits_rows import PUSH_TAKE_ROWS
from kiln.passes.fusion.parallel_linears import FUSE_PARALLEL_LINEARS
from kiln.passes.fusion.rope_attention import FUSE_ROPE_ATTENTION
from kiln.passes.fusion.swiglu import FUSE_SWIGLU
from kiln.passes.kv_cache import KV_CACHE_DTYPE
from kiln.passes.lora import ADD_LORA, FUSE_LORA_PIECES
from kiln.passes.quantize.swap import QUANTIZE_LINEARS

CLEANUP = fixed_point("cleanup", [CANONICALIZE, FOLD_CONSTANTS, CSE, DCE])
LOGITS_ROWS = fixed_point("logits_rows", [PUSH_TAKE_ROWS, CSE, DCE], max_rounds=200)

PIPELINES: dict[int, list[Pass]] = {
    0: [],
    1: [CLEANUP],
    2: [
        CLEANUP,
        FUSE_ROPE_ATTENTION,
        LOGITS_ROWS,
        FUSE_PARALLEL_LINEARS,
        FUSE_SWIGLU,
        FUSE_ADD_RMS_NORM,
        CLEANUP,
    ],
}

PASSES: dict[str, Pass] = {
    p.name: p
    for p in (
        CANONICALIZE,
        FOLD_CONSTANTS,
        CSE,
        DCE,
        CLEANUP,
        FUSE_ROPE_ATTENTION,
        PUSH_TAKE_ROWS,
        LOGITS_ROWS,
        FUSE_PARALLEL_LINEARS,
        FUSE_SWIGLU,
        FUSE_ADD_RMS_NORM,
        QUANTIZE_LINEARS,
        CONVERT_DTYPE,
        KV_CACHE_DTYPE,
        ADD_LORA,
        FUSE_LORA_PIECES,
    )
}


def pipeline(opt_level: int, options: PassOptions) -> list[Pass]:
    if opt_level not in PIPELINES:
        raise PassError(f"unknown optimisation level {opt_level}", hint=f"choose one of {sorted(PIPELINES)}")
    passes = list(PIPELINES[opt_level])
    if options.lora:  # before the fusions, which then see its ops; its pieces fuse before swiglu does
        if FUSE_PARALLEL_LINEARS in passes:
            passes.insert(passes.index(FUSE_PARALLEL_LINEARS) + 1, FUSE_LORA_PIECES)
        passes.insert(0, ADD_LORA)
    if options.quantization is not None:
        passes.insert(0, QUANTIZE_LINEARS)
    if options.dtype != "f32":
        passes.append(CONVERT_DTYPE)
    if options.kv_cache_dtype is not None:
        passes.append(KV_CACHE_DTYPE)
    return passes


def passes_by_name(names: list[str]) -> list[Pass]:
    """An explicit pipeline from pass names (for tests and `--passes`)."""
    unknown = [name for name in names if name not in PASSES]
    if unknown:
        raise PassError(f"unknown pass {unknown[0]!r}", hint=f"known passes: {', '.join(sorted(PASSES))}")
    return [PASSES[name] for name in names]
