"""Kiln's CUDA kernels, run on the CPU from their GPU-scheduled TIR (tests only).

A scheduled PrimFunc (before lowering) is a serial program: a `T.thread_binding` loop becomes a
thread only when the CUDA pipeline lowers it, cross-thread reductions and the barriers that shared
memory needs are added by that pipeline (LowerCrossThreadReduction, ThreadSync). `serialize` turns
every thread-bound loop back into a serial loop and keeps everything else: the tiles and their
shared/local buffers, cache reads, masks, split-K, index arithmetic, the float8 casts. LLVM builds
shared and local buffers as ordinary memory.

Hand-written kernels that place their own barriers (`T.tvm_storage_sync`, attention_cuda.py) cannot
simply be serialized: after a barrier a thread reads what the others wrote before it. There the
thread loop is split at each barrier (loop fission, as CPU OpenCL implementations run work-groups):
for each block index, phase 1 runs for every thread, then phase 2 for every thread, and so on. Each
thread's `local` buffers become one slice each of a buffer [threads, ...] (bound by match_buffer, so
the phase bodies stay unchanged; the binding goes through a TVMScript print / parse round trip, as
TVM 0.27 has no Python statement mutator and the original buffers' offsets are fixed), `shared`
buffers stay one per thread block, and the `T.let`s of the thread body before a phase are evaluated
again at the start of that phase (allowed only if they read no buffer, checked). A barrier must sit
at the top level of the thread body (not inside a loop or a branch); a kernel with one elsewhere is
refused.

What this cannot see: a data race or a missing barrier (threads run one after another here, so no
two ever overlap), and anything below the TIR: TVM's CUDA lowering passes, its code generator, nvcc.
float8 casts are LLVM's here, which read zero and subnormal codes wrong (docs/tvm.md).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
import tvm
from tvm import s_tir, tirx

SYNC = "tirx.tvm_storage_sync"


def _is_sync(stmt: Any) -> bool:
    return (
        isinstance(stmt, tirx.Evaluate)
        and isinstance(stmt.value, tvm.ir.expr.Call)
        and getattr(stmt.value.op, "name", None) == SYNC
    )


def _children(stmt: Any) -> list[Any]:
    if isinstance(stmt, tirx.SeqStmt):
        return list(stmt.seq)
    if isinstance(stmt, s_tir.SBlockRealize):
        return [stmt.block]
    if isinstance(stmt, s_tir.SBlock):
        return [stmt.body] + ([stmt.init] if stmt.init is not None else [])
    if isinstance(stmt, tirx.IfThenElse):
        return [stmt.then_case] + ([stmt.else_case] if stmt.else_case is not None else [])
    if isinstance(stmt, (tirx.For, tirx.While, tirx.AttrStmt)):
        return [stmt.body]
    return []


def _has_sync(stmt: Any) -> bool:
    return _is_sync(stmt) or any(_has_sync(child) for child in _children(stmt))


def _reads_memory(expr: Any) -> bool:
    """Whether a TIR expression loads from a buffer (walks the operators the kernels use)."""
    found = []

    def visit(node: Any) -> None:
        if type(node).__name__ in ("TensorLoad", "BufferLoad"):
            found.append(node)
        elif isinstance(node, tvm.ir.expr.Call):
            for arg in node.args:
                visit(arg)
        else:
            for name in ("a", "b", "value", "condition", "true_value", "false_value", "body"):
                child = getattr(node, name, None)
                if isinstance(child, tvm.ir.expr.Expr):
                    visit(child)

    visit(expr)
    return bool(found)


class _Serializer:
    def __init__(self) -> None:
        self.fissioned = 0  # thread loops split at barriers

    def stmt(self, s: Any) -> Any:
        if isinstance(s, tirx.For):
            if s.kind == tirx.ForKind.THREAD_BINDING:
                if _has_sync(s.body):
                    return self._fission(s)
                return tirx.For(
                    s.loop_var, s.min, s.extent, tirx.ForKind.SERIAL, self.stmt(s.body), None, s.annotations
                )
            return tirx.For(
                s.loop_var,
                s.min,
                s.extent,
                s.kind,
                self.stmt(s.body),
                s.thread_binding,
                s.annotations,
                s.step,
            )
        if isinstance(s, tirx.SeqStmt):
            return tirx.SeqStmt([self.stmt(x) for x in s.seq])
        if isinstance(s, s_tir.SBlockRealize):
            return s_tir.SBlockRealize(s.iter_values, s.predicate, self.stmt(s.block))
        if isinstance(s, s_tir.SBlock):
            return s_tir.SBlock(
                s.iter_vars,
                s.reads,
                s.writes,
                s.name_hint,
                self.stmt(s.body),
                None if s.init is None else self.stmt(s.init),
                s.alloc_buffers,
                s.match_buffers,
                s.annotations,
            )
        if isinstance(s, tirx.IfThenElse):
            otherwise = None if s.else_case is None else self.stmt(s.else_case)
            return tirx.IfThenElse(s.condition, self.stmt(s.then_case), otherwise)
        if isinstance(s, tirx.While):
            return tirx.While(s.condition, self.stmt(s.body))
        if isinstance(s, tirx.AttrStmt):
            return tirx.AttrStmt(s.node, s.attr_key, s.value, self.stmt(s.body))
        if _is_sync(s):
            raise NotImplementedError("a barrier below a loop or branch of the thread body")
        if _children(s):
            raise NotImplementedError(f"gpu_on_cpu: no rewrite for {type(s).__name__}")
        return s  # BufferStore, Bind, Evaluate, AllocBuffer, DeclBuffer, ...

    def _fission(self, outer: Any) -> Any:
        """blockIdx loop(s) -> thread loop(s) -> one opaque block whose body's top level holds barriers."""
        threads: list[Any] = []
        node = outer
        while isinstance(node, tirx.For) and node.kind == tirx.ForKind.THREAD_BINDING:
            threads.append(node)
            node = node.body
        blocks = [f for f in threads if f.thread_binding.thread_tag.startswith("blockIdx")]
        lanes = [f for f in threads if f.thread_binding.thread_tag.startswith("threadIdx")]
        if blocks != threads[: len(blocks)] or len(blocks) + len(lanes) != len(threads) or len(lanes) != 1:
            raise NotImplementedError(
                "barriers in a kernel other than blockIdx loops around one threadIdx loop"
            )
        (lane,) = lanes
        if not isinstance(node, s_tir.SBlockRealize) or node.block.iter_vars or node.block.match_buffers:
            raise NotImplementedError("barriers outside one opaque block directly under the thread loop")
        block = node.block
        body = list(block.body.seq) if isinstance(block.body, tirx.SeqStmt) else [block.body]
        per_thread, expanded, shared = [], [], []
        for buffer in block.alloc_buffers:
            if buffer.scope() == "local":
                whole = tirx.decl_buffer(
                    [lane.extent, *buffer.shape], buffer.dtype, buffer.name + "_threads", scope="local"
                )
                expanded.append(whole)
                region = [tvm.ir.Range.from_min_extent(lane.loop_var, 1)]
                region += [tvm.ir.Range.from_min_extent(0, extent) for extent in buffer.shape]
                per_thread.append(s_tir.MatchBufferRegion(buffer, tirx.BufferRegion(whole, region)))
            else:
                shared.append(buffer)
        phases: list[list[Any]] = [[]]
        lets: list[Any] = []
        for stmt in body:
            if _is_sync(stmt):
                phases.append(list(lets))
                continue
            if isinstance(stmt, tirx.Bind):
                if _reads_memory(stmt.value):
                    raise NotImplementedError(f"a let before a barrier reads memory: {stmt.var}")
                lets.append(stmt)
            if _has_sync(stmt):
                raise NotImplementedError("a barrier below a loop or branch of the thread body")
            phases[-1].append(self.stmt(stmt))
        self.fissioned += 1
        loops = []
        for i, phase in enumerate(phases):
            inner = s_tir.SBlock(
                [], [], [], f"{block.name_hint}_phase{i}", tirx.SeqStmt(phase), None, [], per_thread
            )
            loops.append(
                tirx.For(
                    lane.loop_var,
                    lane.min,
                    lane.extent,
                    tirx.ForKind.SERIAL,
                    s_tir.SBlockRealize([], True, inner),
                )
            )
        result: Any = s_tir.SBlockRealize(
            [],
            True,
            s_tir.SBlock(
                [],
                [],
                [],
                block.name_hint,
                tirx.SeqStmt(loops),
                None,
                shared + expanded,
                [],
                block.annotations,
            ),
        )
        for loop in reversed(blocks):
            result = tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, result)
        return result


def serialize(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The same PrimFunc with its thread-bound loops serial (split at barriers where it has any)."""
    serializer = _Serializer()
    result = func.with_body(serializer.stmt(func.body))
    if serializer.fissioned:
        # Each phase binds the thread's `local` buffers to slice `tx` of their [threads, ...] buffer;
        # the original buffers have a fixed offset 0, so the binding is made through TVMScript: the
        # printed function, its per-thread match_buffers given a free offset, parsed back (the parser
        # resolves the phase bodies' `acc[d]` to the phase's own `acc`).
        text, count = re.subn(
            r"(= T\.match_buffer\(\w+_threads\[[^\n]*)\)\n", r"\1, offset_factor=1)\n", result.script()
        )
        assert count, "no per-thread buffer was bound"
        result = tvm.script.from_source(text)
    return result


def count_thread_loops(func: tirx.PrimFunc) -> dict[str, int]:
    """Thread tags of the function's thread-bound loops (a check that the GPU schedule was taken)."""
    tags: dict[str, int] = {}

    def visit(stmt: Any) -> None:
        if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.THREAD_BINDING:
            tag = stmt.thread_binding.thread_tag
            tags[tag] = tags.get(tag, 0) + 1
        for child in _children(stmt):
            visit(child)

    visit(func.body)
    return tags


def scopes(func: tirx.PrimFunc) -> set[str]:
    """Storage scopes of the buffers the function's blocks allocate."""
    found: set[str] = set()

    def visit(stmt: Any) -> None:
        if isinstance(stmt, s_tir.SBlock):
            found.update(buffer.scope() for buffer in stmt.alloc_buffers)
        for child in _children(stmt):
            visit(child)

    visit(func.body)
    return found


def build(func: tirx.PrimFunc) -> Any:
    """`serialize`d and compiled for the host CPU (LLVM); returns the callable."""
    cpu = serialize(func).with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": cpu}), target="llvm")["main"]


def array(value: torch.Tensor | np.ndarray) -> Any:
    """A tvm tensor on the CPU (float8 through dlpack, which numpy lacks)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    return tvm.runtime.from_dlpack(value.contiguous().clone())


CUDA_TARGET = {"kind": "cuda", "arch": "sm_90"}


def gpu_step_module(graph: Any) -> tuple[Any, tvm.IRModule]:
    """(lowered, module): `step` and `decode` of `graph` as the CUDA build makes them (cuda_build.py:
    lower_graph with the GPU schedules, then fused and scheduled by dlight), up to the point where every
    PrimFunc is the TIR the CUDA code generator gets. No nvcc, no GPU."""
    from kiln.backends.tvm.cuda_build import decode_gemv, fuse_and_schedule, schedule_gpu
    from kiln.backends.tvm.lowering import lower_graph

    target = tvm.target.Target(CUDA_TARGET, host={"kind": "llvm"})
    with target:
        lowered = lower_graph(graph, "cuda", schedule_gpu, decode=True, decode_kernels=decode_gemv)
        module = tvm.transform.Sequential(fuse_and_schedule())(lowered.module)
    return lowered, module


def gpu_kernels(module: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in module.functions.items() if isinstance(f, tirx.PrimFunc)}


def cpu_step_library(module: tvm.IRModule, folder: Any) -> Any:
    """`gpu_step_module`'s module with every PrimFunc `serialize`d, the rest of the CUDA build's Relax
    pipeline run, compiled for the host CPU and exported as folder/step.so (the CPU runtime loads it)."""
    from kiln.backends.tvm.cuda_build import to_vm

    serialized = tvm.IRModule(
        {gv: (serialize(f) if isinstance(f, tirx.PrimFunc) else f) for gv, f in module.functions.items()},
        attrs=module.attrs,
    )
    target = tvm.target.Target({"kind": "llvm"})
    with target:
        lowered = tvm.transform.Sequential(to_vm())(serialized)
        executable = tvm.compile(lowered, target=target, relax_pipeline=None)
    library = folder / "step.so"
    executable.export_library(str(library))
    return library


def cpu_executable_of_gpu_step(program: Any, folder: Any) -> Any:
    """A TVMExecutable (the CPU runtime path) running `program`'s CUDA kernels, serialized, on the CPU."""
    from kiln.backends.tvm.executable import TVMExecutable
    from kiln.ir.step import StepSignature

    lowered, module = gpu_step_module(program.graph)
    folder.mkdir(parents=True, exist_ok=True)
    library = cpu_step_library(module, folder)
    params = [spec.to_dict() for spec in lowered.params]
    signature = StepSignature.of_graph(program.graph, lowered.functions, lowered.embed_width)
    return TVMExecutable(
        library, params, program.weights, signature, "cpu", embed_params=lowered.embed_params
    )
