"""CPU code generation: LLVM targets for this host or another x86 CPU, and the kernels' CPU schedules."""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import relax, tirx

from kiln.backends.targets import Target
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels import rowwise
from kiln.backends.tvm.kernels.int_dot import Isa, choose_isa

TRIPLE = "x86_64-unknown-linux-gnu"


def host_mcpu() -> str:
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


def target_mcpu(target: Target) -> str:
    return target.detail or host_mcpu()


def is_valid_mcpu(mcpu: str) -> bool:
    from tvm.target import codegen

    return bool(codegen.llvm_is_valid_cpu(mcpu, TRIPLE))


def llvm_target(target: Target, num_threads: int | None = None) -> tvm.target.Target:
    cores = num_threads or os.cpu_count() or 1
    return tvm.target.Target(
        {"kind": "llvm", "mtriple": TRIPLE, "mcpu": target_mcpu(target), "num-cores": cores}
    )


def schedule_cpu(kind: str, func: tirx.PrimFunc, info: dict[str, Any]) -> tuple[tirx.PrimFunc, str]:
    """The hand-written CPU schedule template for a kiln kernel; (scheduled func, where it came from)."""
    if kind in ("linear", "qlinear"):
        return linear_kernels.schedule_linear_cpu(func, info["n"], info["quant"]), "templated"
    if kind == "rms_norm":
        return rowwise.schedule_rms_norm_cpu(func, info["hidden"], info["with_residual"]), "templated"
    if kind == "rope":
        return rowwise.schedule_rope_cpu(func), "templated"
    if kind == "swiglu":
        return rowwise.schedule_swiglu_cpu(func, info["intermediate"]), "templated"
    return func, "hand-written TIR"  # attention, kv_write and qgemm are written scheduled


def build_cpu(module: tvm.IRModule, target: tvm.target.Target) -> relax.VMExecutable:
    """Legalize the remaining Relax ops, fuse the element-wise ones, compile with LLVM."""
    with target:
        module = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
            ]
        )(module)
        return tvm.compile(module, target=target)


def required_features(target: tvm.target.Target) -> list[str]:
    """The checked x86 features the target's code may use (see cpu_features.py)."""
    from kiln.backends.tvm.cpu_features import CHECKED_FEATURES

    enabled = llvm_features(target)
    return [name for name, llvm_name in CHECKED_FEATURES.items() if llvm_name in enabled]


def llvm_features(target: tvm.target.Target) -> set[str]:
    from tvm.target import codegen

    return {str(name) for name in codegen.llvm_get_cpu_features(target)}


def int_dot_isa(target: tvm.target.Target) -> Isa | None:
    """The integer dot-product variant the quantized linears use on this target (None: float)."""
    return choose_isa(llvm_features(target))
