"""CPU code generation: LLVM targets for this host or another x86-64 or aarch64 CPU (linked with that
machine's cross compiler), and the kernels' CPU schedules."""

from __future__ import annotations

import os
from typing import Any

import tvm
from tvm import relax, tirx

from kiln.backends.targets import Target, cross_compiler, host_machine
from kiln.backends.tvm.kernels import dense_attention, rowwise
from kiln.backends.tvm.kernels import linear as linear_kernels
from kiln.backends.tvm.kernels.int_dot import Isa, choose_isa


def host_mcpu() -> str:
    from tvm.target import codegen

    return str(codegen.llvm_get_system_cpu())


def target_mcpu(target: Target) -> str:
    if target.detail is not None:
        return target.detail
    return host_mcpu() if target.machine == host_machine() else "generic"


def is_valid_mcpu(mcpu: str, triple: str) -> bool:
    from tvm.target import codegen

    return bool(codegen.llvm_is_valid_cpu(mcpu, triple))


def llvm_target(target: Target, num_threads: int | None = None) -> tvm.target.Target:
    cores = num_threads or os.cpu_count() or 1
    description = {"kind": "llvm", "mtriple": target.triple, "mcpu": target_mcpu(target), "num-cores": cores}
    if target.detail is None and target.machine == host_machine():
        description["mattr"] = host_mattr()
    return tvm.target.Target(description)


def host_mattr() -> list[str]:
    """AMX on this host exactly when Linux grants the process its tile data: a VM may report an older
    model, whose LLVM name lacks AMX, and a kernel may refuse AMX on a CPU whose name has it."""
    from kiln.backends.tvm.cpu_features import enable_amx

    if host_machine() != "x86_64":
        return []
    sign = "+" if enable_amx() else "-"
    return [f"{sign}amx-tile", f"{sign}amx-int8"]


def export(executable: relax.VMExecutable, path: str, target: Target) -> None:
    """step.so, linked by this machine's compiler or the target machine's cross compiler."""
    from tvm.support import cc

    compiler = cross_compiler(target)
    fcompile = cc.cross_compiler(compiler) if compiler is not None else None
    executable.export_library(path, fcompile=fcompile)


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
    if kind == "batched_matmul":
        return dense_attention.schedule_batched_matmul_cpu(func, info["n"]), "templated"
    if kind == "masked_softmax":
        return dense_attention.schedule_masked_softmax_cpu(func, info["rows"]), "templated"
    return func, "hand-written TIR"  # attention, kv_write and qgemm are written scheduled


def build_cpu(module: tvm.IRModule, target: tvm.target.Target) -> relax.VMExecutable:
    """Legalize the remaining Relax ops, fuse the element-wise ones, compile with LLVM (tvm.compile's
    default Relax pipeline, its shape functions' stores put in a fixed order: reproducible.py)."""
    from kiln.backends.tvm.reproducible import default_relax_pipeline

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
        return tvm.compile(module, target=target, relax_pipeline=default_relax_pipeline())


def required_features(target: tvm.target.Target) -> list[str]:
    """The checked CPU features the target's code may use (see cpu_features.py)."""
    from kiln.backends.tvm.cpu_features import checked_features

    enabled = llvm_features(target)
    machine = "aarch64" if str(target.attrs["mtriple"]).startswith("aarch64") else "x86_64"
    return [name for name, llvm_name in checked_features(machine).items() if llvm_name in enabled]


def llvm_features(target: tvm.target.Target) -> set[str]:
    from tvm.target import codegen

    return {str(name) for name in codegen.llvm_get_cpu_features(target)}


def int_dot_isa(target: tvm.target.Target) -> Isa | None:
    """The integer dot-product variant the quantized linears use on this target (None: float)."""
    return choose_isa(llvm_features(target))
