"""The CUDA build of `step`, run as its own process: `python -m kiln.backends.tvm.cuda_build REQUEST.json`.

Why a process of its own: TVM decides when it is imported whether its CUDA runtime plugin
(libtvm_runtime_cuda.so, which needs libcuda.so.1) loads. Without it, TVM's CUDA codegen keeps the
kernels as CUDA C source (compiled on the GPU box at load time, with nvcc or NVRTC there); with it,
codegen calls `tvm_callback_cuda_compile` and embeds a fatbin. On a machine without a GPU driver,
cuda.py starts this process with a libcuda stub (cudastub/stub.c, every call fails with
CUDA_ERROR_NO_DEVICE) first on LD_LIBRARY_PATH, so the plugin loads and nvcc writes real device code.
The parent process, which may already have imported TVM, is left untouched.

The request names the IR graph (JSON; the build needs no weight values), the arch, whether to emit
PTX next to the SASS; this writes <out>/step.so and a result JSON (parameters, kernel origins,
timings). Relax's RewriteCUDAGraph is not run: CUDA graphs are captured by the runtime, per decode
bucket (cuda_graphs.py), and Relax's captures would nest inside those.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.support import cc, nvcc

from kiln.backends.base import BackendError
from kiln.backends.tvm.lowering import ENCODE_IMAGE, lower_encoder, lower_graph
from kiln.backends.tvm.reproducible import sort_shape_func_stores
from kiln.ir import graph_from_json

LINEAR_COLUMNS = 32
LINEAR_SPLIT_K = 8
GEMM_ROW_BLOCKS = 8  # blocks of 4 rows a thread block: 32 rows, one threadIdx.y each
GEMM_COLUMNS = 64  # output columns a thread block
GEMM_THREAD_COLUMNS = 4  # adjacent columns a thread: 4 rows x 4 columns of sums in registers
GEMM_K = 16  # k a shared-memory weight tile: [16, 64] float32, 4 KiB
SPLIT_K_ORIGIN = "templated (GPU split-K)"
GEMM_ORIGIN = "templated (GPU tiled GEMM)"


def gpu_rules() -> list[Any]:
    return [
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


def schedule_linear_gpu(func: tirx.PrimFunc, threads: bool = True) -> tirx.PrimFunc:
    """y[q, 4, N] = x @ W as split-K GEMV: a block per (row block, 32 columns), 32 x 8 threads; threadIdx.x
    walks 32 adjacent columns (coalesced weight reads), threadIdx.y splits K in 8 and the 8 partial
    sums meet in a cross-thread reduction; the 4 rows of a block run in turn (weights hot in L1).
    Layout stages (weight_kn, dequantize) are inlined into the reduction. `threads=False`: the same
    loops left serial, so a CPU can run the schedule's arithmetic (tests)."""
    sch = s_tir.Schedule(func)
    bind = _binder(sch, threads)
    for name in ("weight_kn", "scales_f32", "zeros_f32", "dequantize"):
        if _has_block(sch, name):
            sch.compute_inline(sch.get_sblock(name))
    block = sch.get_sblock("linear")
    a, b, j, k = sch.get_loops(block)
    jo, ji = sch.split(j, [None, LINEAR_COLUMNS])
    ko, ki = sch.split(k, [None, LINEAR_SPLIT_K])
    sch.reorder(a, jo, ji, b, ki, ko)
    bind(a, "blockIdx.y")
    bind(jo, "blockIdx.x")
    bind(ji, "threadIdx.x")
    bind(ki, "threadIdx.y")
    out = sch.get_sblock("out")
    outer, inner = sch.split(sch.fuse(*sch.get_loops(out)), [None, 256])
    bind(outer, "blockIdx.x")
    bind(inner, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_gemm_gpu(func: tirx.PrimFunc, threads: bool = True) -> tirx.PrimFunc:
    """y[q, 4, N] = x @ W as a tiled GEMM for many rows: a block per (32 rows, 64 columns), 16 x 8
    threads, each summing 4 rows x 4 adjacent columns in registers. Per step of 16 k the block
    dequantizes (or copies) the weight tile [16, 64] into shared memory once, for all its 32 rows,
    where the split-K GEMV reads every weight once per 4 rows. Rows past q are masked.
    `threads=False`: the same loops serial and the tile in a plain buffer (tests, on a CPU)."""
    sch = s_tir.Schedule(func)
    bind = _binder(sch, threads)
    for name in ("scales_f32", "zeros_f32"):
        if _has_block(sch, name):
            sch.compute_inline(sch.get_sblock(name))
    block = sch.get_sblock("linear")
    a, b, j, k = sch.get_loops(block)
    threads_x = GEMM_COLUMNS // GEMM_THREAD_COLUMNS
    a_outer, a_inner = sch.split(a, [None, GEMM_ROW_BLOCKS])
    j_outer, j_thread, j_inner = sch.split(j, [None, threads_x, GEMM_THREAD_COLUMNS])
    k_outer, k_inner = sch.split(k, [None, GEMM_K])
    sch.reorder(a_outer, j_outer, a_inner, j_thread, k_outer, k_inner, b, j_inner)
    bind(a_outer, "blockIdx.y")
    bind(j_outer, "blockIdx.x")
    bind(a_inner, "threadIdx.y")
    bind(j_thread, "threadIdx.x")
    sums = sch.cache_write(block, 0, "local")
    sch.reverse_compute_inline(sch.get_sblock("out"))  # bias and cast on the way out of registers
    sch.reverse_compute_at(sums, j_thread)
    weight = sch.get_sblock("dequantize" if _has_block(sch, "dequantize") else "weight_kn")
    if threads:
        sch.set_scope(weight, 0, "shared")
    sch.compute_at(weight, k_outer)
    _, thread_y, thread_x = sch.split(
        sch.fuse(*sch.get_loops(weight)[-2:]), [None, GEMM_ROW_BLOCKS, threads_x]
    )
    bind(thread_y, "threadIdx.y")
    bind(thread_x, "threadIdx.x")
    sch.decompose_reduction(block, k_outer)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _binder(sch: s_tir.Schedule, threads: bool) -> Any:
    return sch.bind if threads else (lambda loop, thread: None)


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and "tirx.is_scheduled" in func.attrs


def _has_block(sch: s_tir.Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # tvm raises a plain error for an unknown block name
        return False
    return True


def schedule_gpu(kind: str, func: tirx.PrimFunc, info: dict[str, Any]) -> tuple[tirx.PrimFunc, str]:
    """The GPU schedule of a kiln kernel in `step`: the tiled GEMM for linear layers, dlight's GPU
    rules (first that applies) for the row-wise TE kernels; attention / kv_write come scheduled.
    Runs inside `with target:` (dlight reads the thread limits from the current target)."""
    if _is_scheduled(func):
        return func, "hand-written TIR"
    if kind in ("linear", "qlinear"):
        return schedule_gemm_gpu(func), GEMM_ORIGIN
    for rule in gpu_rules():
        try:
            scheduled = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
        except Exception:  # a rule that matches the pattern but cannot schedule it: try the next
            continue
        if _is_scheduled(scheduled):
            return scheduled, f"dlight {type(rule).__name__}"
    raise BackendError(
        f"tvm: no dlight GPU rule schedules the {kind} kernel",
        hint="add a GPU schedule for it in backends/tvm/cuda_build.py",
    )


def decode_gemv(
    kind: str, key: tuple[Any, ...], func: tirx.PrimFunc, info: dict[str, Any]
) -> tuple[tirx.PrimFunc, str] | None:
    """`decode` (one block of 4 rows) takes the split-K GEMV for linear layers, `step`'s kernels
    for the rest."""
    if kind in ("linear", "qlinear") and not _is_scheduled(func):
        return schedule_linear_gpu(func), SPLIT_K_ORIGIN
    return None


def _register_device_compiler(arch: str, compiler: str, ptx: bool, calls: list[dict[str, Any]]) -> None:
    """nvcc → fatbin with SASS for `arch` (and its PTX, so newer GPUs can JIT it); nvrtc12 (CUDA 12's
    NVRTC, for the archs CUDA 13 dropped) → a cubin with SASS only."""
    suffix = arch.removeprefix("sm_")
    if compiler == "nvrtc12":
        flags = ["nvrtc12", f"--gpu-architecture={arch}"]
    else:
        flags = ["-gencode", f"arch=compute_{suffix},code=sm_{suffix}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{suffix},code=compute_{suffix}"]

    @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
    def _compile(code: str) -> bytearray:
        start = time.perf_counter()
        if compiler == "nvrtc12":
            binary = nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")
        else:
            binary = nvcc.compile_cuda(code, target_format="fatbin", arch=flags, compiler="nvcc")
        calls.append({"seconds": time.perf_counter() - start, "bytes": len(binary), "flags": flags})
        return binary


def fuse_and_schedule() -> list[Any]:
    """The Relax passes that turn the lowered `step` into its final kernels: the Relax ops (reshapes,
    adds, embeddings, SwiGLU on GPUs, ...) legalized, fused and scheduled by dlight's GPU rules (the
    templated and hand-written kernels are scheduled already). Run inside `with target:`; after it,
    every PrimFunc in the module is the TIR the CUDA code generator gets (the tests run these on a CPU:
    tests/backends/tvm/kernels/gpu_on_cpu.py)."""
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(*gpu_rules()),
    ]


def to_vm() -> list[Any]:
    """The Relax passes from the scheduled kernels to what the VM runs: memory planned, shapes lowered,
    symbols attached (the tests run them on the serialised kernels for the CPU)."""
    return [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
        sort_shape_func_stores,  # VMShapeLower's store order varies: reproducible.py
    ]


def _launched_kernels(module: tvm.IRModule) -> set[str]:
    """Names of the PrimFuncs the Relax functions call (reshapes that became views are not among them)."""
    prim = {gv.name_hint for gv, func in module.functions.items() if isinstance(func, tirx.PrimFunc)}
    called: set[str] = set()

    def visit(expr: Any) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar):
            called.add(expr.op.name_hint)
        elif isinstance(expr, relax.GlobalVar):
            called.add(expr.name_hint)

    for func in module.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return called & prim


def build(request: dict[str, Any]) -> dict[str, Any]:
    arch, out = request["arch"], Path(request["out"])
    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
        raise BackendError(
            "tvm: TVM's CUDA runtime plugin did not load (no libcuda.so.1), so the library would hold CUDA "
            "source instead of device code",
            hint="run this through kiln.backends.tvm.cuda.compile_cuda, which puts a libcuda stub first",
        )
    times: dict[str, float] = {}
    nvcc_calls: list[dict[str, Any]] = []
    compiler = request["device_compiler"]
    with_ptx = bool(request["ptx"]) and compiler == "nvcc"
    _register_device_compiler(arch, compiler, with_ptx, nvcc_calls)
    graph = graph_from_json(json.loads(Path(request["graph"]).read_text()))
    host = {"kind": "llvm", "mtriple": request["host_triple"]}
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host=host)
    start = time.perf_counter()
    encoder = request.get("entry") == ENCODE_IMAGE
    with target:
        if encoder:  # a vision-language model's image encoder: one function over one image's rows
            lowered = lower_encoder(graph, "cuda", schedule_gpu)
        else:
            lowered = lower_graph(graph, "cuda", schedule_gpu, decode=True, decode_kernels=decode_gemv)
        times["lower_and_schedule_kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        module = tvm.transform.Sequential([*fuse_and_schedule(), *to_vm()])(lowered.module)
        times["relax_pipeline"] = time.perf_counter() - start
        fused = {
            name: "dlight (fused Relax ops)"
            for name in _launched_kernels(module)
            if name not in lowered.kernel_origins and not name.startswith("shape_func")
        }
        start = time.perf_counter()
        executable = tvm.compile(module, target=target, relax_pipeline=None)
        times["codegen_and_nvcc"] = time.perf_counter() - start
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    linker = request["cross_compiler"]
    executable.export_library(
        str(out / request.get("library", "step.so")),
        fcompile=cc.cross_compiler(linker) if linker is not None else None,
    )
    times["export"] = time.perf_counter() - start
    times["nvcc"] = sum(call["seconds"] for call in nvcc_calls)
    if not nvcc_calls:
        raise BackendError("tvm: the CUDA build never called nvcc, so step.so carries no device code")
    return {
        "params": [spec.to_dict() for spec in lowered.params],
        "kernels": {**fused, **lowered.kernel_origins},
        "functions": lowered.functions,
        "embed_params": lowered.embed_params,
        "embed_width": lowered.embed_width,
        "nvcc_flags": nvcc_calls[-1]["flags"],
        "ptx": with_ptx,
        "seconds": times,
    }


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[0]).read_text())
    try:
        result = build(request)
    except BackendError as error:
        print(f"kiln cuda build: {error}" + (f" (hint: {error.hint})" if error.hint else ""), file=sys.stderr)
        return 3
    Path(request["result"]).write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
