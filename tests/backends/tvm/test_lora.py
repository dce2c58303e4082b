"""LoRA adapters as run-time data on the TVM backend (ir/ops/lora.py, kernels/lora.py, ops_lora.py).

The kernel, CPU and CUDA (its GPU TIR run on the CPU: tests/backends/tvm/kernels/gpu_on_cpu.py),
against the op's torch reference: pieces of a fused linear, odd ranks and widths, rows without an
adapter (left bit-for-bit alone), rows past the step's real ones, tables without slots (LS = LR = 0),
unaligned tables, float16. The tiny Llama compiled with LoRA (float32, and int8) against the reference
backend on a ragged prefill and a mixed step of decodes and a chunk, rows of slots 0, 1, 2 and -1,
each row's logits the same bits alone as in the batch; slot -1 rows the bits of a step given no LoRA
inputs; tables written in place between steps (as the runtime loads an adapter) read by the next
step; the manifest's record; bad tables and slots refused. CUDA: the step's CUDA kernels run on the CPU
against the reference, a CUDA graph's stand-in replaying a padded decode with the tables (written in
place between replays), and a cross-compile for sm_90 (nvcc, no GPU)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi

from kiln.backends.base import BackendError, CompileSettings
from kiln.backends.lora_tables import LoRASpec
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm import cuda
from kiln.backends.tvm.backend import DESCRIPTION
from kiln.backends.tvm.cuda_build import schedule_gpu
from kiln.backends.tvm.cuda_graphs import DecodeGraphs, decode_bucket, pad_decode, table_width
from kiln.backends.tvm.executable import step_tensors
from kiln.backends.tvm.kernels import lora as lora_kernels
from kiln.backends.tvm.staging import InputStaging
from kiln.compiler.build import PipelineOptions, optimize
from kiln.ir import Program
from kiln.ir.host_arrays import as_torch
from kiln.ir.ops.lora import lora
from kiln.ir.step import (
    LORA_A_PREFIX,
    LORA_B_PREFIX,
    LORA_SLOTS_INPUT,
    SequenceSlice,
    StepInputs,
    StepSignature,
    build_step_inputs,
    fill_absent,
)
from tests.backends.tvm.replay_stand_in import rerun_capture

BLOCK_SIZE = 4
TOLERANCE = 1e-4  # max |tvm - reference| / max |reference|: float32, sums in other orders
QUANTIZED_TOLERANCE = 1e-3  # int8: TVM's integer-dot kernels quantize the activations (test_cpu.py)
SLOTS, RANK, SCALE = 3, 4, 0.1  # the adapters: 3 slots of rank 4, values ~ 0.1: they matter, stay sane


def _gpu_on_cpu() -> Any:
    kernels = str(Path(__file__).with_name("kernels"))
    if kernels not in sys.path:
        sys.path.insert(0, kernels)
    import gpu_on_cpu

    return gpu_on_cpu


# --- the kernel -----------------------------------------------------------------------------------------

# (k, pieces' sizes, slots of the rows, real rows, LS, LR, dtype)
KERNEL_CASES = {
    "qkv-rank4": (32, [32, 16, 16], [0, 1, -1, 2, 0, -1, -1, 1], 8, 3, 4, "float32"),
    "odd-widths-rank7": (36, [42], [1, -1, 0, 1], 4, 2, 7, "float32"),
    "gate-up-rank16-padding": (64, [48, 48], [0, -1, 0, 0, 0, 0, 0, 0], 5, 1, 16, "float32"),
    "four-pieces-rank33": (16, [8, 24, 16, 8], [2, 0, 3, 1], 4, 4, 33, "float32"),
    "no-slots": (64, [32], [-1, -1, -1, -1], 4, 0, 0, "float32"),
    "float16": (48, [32, 16], [1, 0, -1, 1], 4, 2, 8, "float16"),
    "float16-tables": (48, [32, 16], [1, 0, -1, 1, 0], 5, 2, 16, "float32"),
}
TABLE_DTYPES = {"float16-tables": "float16"}  # the tables' dtype where it is not the activations'


def _case(name: str) -> tuple:
    return (*KERNEL_CASES[name], TABLE_DTYPES.get(name, KERNEL_CASES[name][-1]))


def _kernel_inputs(case: tuple) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the kernel's tensors: y, x, slots, tables, counts; the reference's result)."""
    k, sizes, slots, real, num_slots, rank, dtype, table_dtype = case
    generator = torch.Generator().manual_seed(7)
    torch_dtype = getattr(torch, dtype)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch_dtype) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    rows = len(slots)
    y, x = rand(rows, sum(sizes)), rand(rows, k)
    tables = []
    for size in sizes:  # 2 layers, layer 1 used
        narrow = getattr(torch, table_dtype)
        tables += [
            rand(2, num_slots, rank, k, scale=SCALE, dtype=narrow),
            rand(2, num_slots, rank, size, scale=SCALE, dtype=narrow),
        ]
    index = torch.tensor(slots, dtype=torch.int64)
    expected = y.clone()
    expected[:real] = lora(y[:real], x[:real], index[:real], *tables, layer=1, sizes=sizes)
    counts = torch.tensor([real, rows], dtype=torch.int64)
    return [y, x, index, *tables, counts], expected


def _unaligned(table: torch.Tensor) -> torch.Tensor:
    """`table` copied to an address 4 bytes past a multiple of 64 (numpy aligns its arrays to 16)."""
    raw = torch.zeros(table.numel() + 64, dtype=table.dtype)
    start = ((-raw.data_ptr() % 64) + 4) // table.element_size()
    view = raw[start : start + table.numel()].view(table.shape)
    view.copy_(table)
    assert view.data_ptr() % 64 == 4
    return view


def _run_kernel(function: Any, tensors: list[torch.Tensor], unaligned: bool = False) -> torch.Tensor:
    y, x, slots, *tables, counts = (t.clone() for t in tensors)
    if unaligned:
        tables = [_unaligned(table) for table in tables]
    function(*(_tvm(t) for t in (y, x, slots, *tables, counts)), 0, 1)  # token rows, layer 1
    return y


def _tvm(tensor: torch.Tensor) -> Any:
    """`tensor` for TVM; an empty one as a view of one element (DLPack's strides of an empty tensor fail
    TVM's compact-array check: the executable does the same)."""
    if tensor.numel():
        return tvm_ffi.from_dlpack(tensor)
    view = tvm_ffi.get_global_func("runtime.TVMTensorCreateView")
    base = tvm_ffi.from_dlpack(torch.zeros(1, dtype=tensor.dtype))
    return view(
        base, tvm_ffi.Shape(tuple(tensor.shape)), tvm_ffi.dtype(str(tensor.dtype).removeprefix("torch.")), 0
    )


def _cpu_kernel(k: int, sizes: list[int], dtype: str, table_dtype: str | None = None) -> Any:
    func = lora_kernels.lora_kernel(k, sizes, dtype, "cpu", table_dtype).with_attr("global_symbol", "main")
    return tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target({"kind": "llvm"}))["main"]


def _cuda_kernel(k: int, sizes: list[int], dtype: str, table_dtype: str | None = None) -> Any:
    """The kernel `step` gets on a GPU (ops_lora.py, then cuda_build.schedule_gpu), built for the CPU."""
    gpu_on_cpu = _gpu_on_cpu()
    target = tvm.target.Target(gpu_on_cpu.CUDA_TARGET, host={"kind": "llvm"})
    with target:
        kernel, origin = schedule_gpu(
            "lora", lora_kernels.lora_kernel(k, sizes, dtype, "cuda", table_dtype), {}
        )
    assert origin == "hand-written TIR"
    assert gpu_on_cpu.count_thread_loops(kernel) == {"blockIdx.x": 1, "threadIdx.x": 1}
    return gpu_on_cpu.build(kernel)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_the_kernel_matches_the_reference(case: str, target: str) -> None:
    k, sizes, slots, real, _, _, dtype, table_dtype = _case(case)
    tensors, expected = _kernel_inputs(_case(case))
    function = (_cpu_kernel if target == "cpu" else _cuda_kernel)(k, sizes, dtype, table_dtype)
    got = _run_kernel(function, tensors, unaligned=target == "cpu" and case == "qkv-rank4")
    untouched = [r for r, s in enumerate(slots) if s < 0 or r >= real]  # no adapter, or padding
    assert torch.equal(got[untouched], tensors[0][untouched])
    tolerance = 2e-3 if dtype == "float16" else 1e-6
    error = float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
    assert error < tolerance, (case, target, error)
    if dtype == "float32" and real == len(slots):  # the update really is there
        assert not torch.equal(got, tensors[0]) or all(s < 0 for s in slots)


def test_the_cuda_kernel_compiles_to_cuda_with_its_barrier() -> None:
    """CUDA codegen (no nvcc, no GPU): float16 tables, three pieces; the barriers after the warps'
    partial sums and after the low-rank vector, both in static shared memory (within the 48 KiB every
    arch allows without opting in)."""
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    module = tvm.IRModule({"lora": lora_kernels.lora_kernel(576, [576, 192, 192], "float16", "cuda")})
    with target:
        source = tvm.tirx.build(module, target=target).imports[0].inspect_source("cuda")
    (threads,) = re.findall(r"__launch_bounds__\((\d+)\) lora_kernel\(", source)[:1]
    assert int(threads) == lora_kernels.THREADS
    assert source.count("__syncthreads()") == 2
    shared = sorted(int(size) for size in re.findall(r"__shared__ alignas\(\d+\) float \w+\[(\d+)\]", source))
    assert shared == [lora_kernels.MAX_RANK, lora_kernels.MAX_RANK * lora_kernels.WARP]
    assert sum(shared) * 4 <= 48 * 1024


# --- the tiny Llama ---------------------------------------------------------------------------------------

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18]]
BLOCKS = [[1, 2, 9], [3, 10], [4, 5, 11], [6, 12]]
ADAPTERS = [0, 1, -1, 2]  # each sequence's slot
CHUNK = 2  # the sequence whose second step is a chunk of 3 tokens (the others decode one)


def _tables(spec: LoRASpec, seed: int) -> dict[str, np.ndarray]:
    tables = spec.allocate(SLOTS, RANK)
    generator = np.random.default_rng(seed)
    for table in tables.values():
        table[...] = generator.standard_normal(table.shape).astype(table.dtype) * SCALE
    return tables


def _second_tokens(i: int) -> list[int]:
    return [40 + i, 41 + i, 42 + i] if i == CHUNK else [40 + i]


def _steps(sequences: list[int], tables: dict[str, np.ndarray] | None) -> list[StepInputs]:
    """The prefill of `sequences` (every row's logits), then their decodes and CHUNK's chunk."""
    prefill = [
        SequenceSlice(PROMPTS[i], 0, BLOCKS[i], range(len(PROMPTS[i])), lora_slot=ADAPTERS[i])
        for i in sequences
    ]
    second = [
        SequenceSlice(
            _second_tokens(i),
            len(PROMPTS[i]),
            BLOCKS[i],
            range(len(_second_tokens(i))),
            lora_slot=ADAPTERS[i],
        )
        for i in sequences
    ]
    steps = [build_step_inputs(slices, BLOCK_SIZE, lora=True) for slices in (prefill, second)]
    return [step.with_optional(tables or {}) for step in steps]


def _rows_of(sequence: int, step: int) -> slice:
    """Sequence `sequence`'s rows in step `step` (0: prefill, 1: the second) of all the sequences."""
    counts = [len(PROMPTS[i]) if step == 0 else len(_second_tokens(i)) for i in range(len(PROMPTS))]
    start = sum(counts[:sequence])
    return slice(start, start + counts[sequence])


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _compiled(tiny_llama, folder: Path, tvm_compile, quantization: str | None) -> tuple[Program, Any]:
    config, weights = tiny_llama
    extra = {"quantization": quantization} if quantization else {}
    options = PipelineOptions(opt_level=2, enable_lora=True, kv_cache_dtype="f32", **extra)
    program = optimize(config, weights, options).program
    assert sum(node.op == "lora" for node in program.graph.nodes) == 8  # q|k|v, o, gate|up, down; 2 layers
    return program, tvm_compile(program, folder)


@pytest.fixture(scope="module")
def lora_f32(tiny_llama, tmp_path_factory, tvm_compile) -> tuple[Program, Any, Path]:
    folder = tmp_path_factory.mktemp("tvm-lora-f32")
    return (*_compiled(tiny_llama, folder, tvm_compile, None), folder)


@pytest.fixture(scope="module")
def lora_int8(tiny_llama, tmp_path_factory, tvm_compile) -> tuple[Program, Any, Path]:
    folder = tmp_path_factory.mktemp("tvm-lora-int8")
    return (*_compiled(tiny_llama, folder, tvm_compile, "int8"), folder)


@pytest.mark.parametrize("kind", ["f32", pytest.param("int8", marks=pytest.mark.slow)])  # int8: a 20 s build
def test_steps_mixing_adapters_match_the_reference_and_each_row_alone(kind: str, request) -> None:
    program, ours, _ = request.getfixturevalue(f"lora_{kind}")
    tolerance = TOLERANCE if kind == "f32" else QUANTIZED_TOLERANCE
    reference = ReferenceExecutable(program.graph, program.weights)
    tables = _tables(ours.lora_spec, seed=1)
    everyone = list(range(len(PROMPTS)))
    caches = [e.kv_cache_spec.allocate(16, BLOCK_SIZE) for e in (ours, reference)]
    batched = []
    for step in _steps(everyone, tables):
        mine, theirs = (e.step(step, cache) for e, cache in zip((ours, reference), caches, strict=True))
        assert _relative_error(mine, theirs) < tolerance, kind
        batched.append(mine)
    assert _relative_error(caches[0], caches[1]) < tolerance  # the K/V each layer wrote
    # the adapters matter: rows with a slot differ from the base model's (the same steps, no LoRA inputs)
    base_cache = ours.kv_cache_spec.allocate(16, BLOCK_SIZE)
    base = [
        ours.step(step.without(LORA_SLOTS_INPUT, LORA_A_PREFIX, LORA_B_PREFIX), base_cache)
        for step in _steps(everyone, None)
    ]
    for i in everyone:
        rows = _rows_of(i, 0)
        if ADAPTERS[i] < 0:  # slot -1: the base model's bits
            assert np.array_equal(batched[0][rows], base[0][rows])
            assert np.array_equal(batched[1][_rows_of(i, 1)], base[1][_rows_of(i, 1)])
        else:
            assert np.abs(batched[0][rows] - base[0][rows]).max() > 10 * tolerance * np.abs(base[0]).max()
    # each sequence alone (its second step a decode of one row: `decode`): the batch's bits
    for i in everyone:
        cache = ours.kv_cache_spec.allocate(16, BLOCK_SIZE)
        for index, step in enumerate(_steps([i], tables)):
            alone = ours.step(step, cache)
            assert np.array_equal(alone, batched[index][_rows_of(i, index)]), (kind, i, index)


def test_padding_rows_and_steps_given_no_slots_get_slot_minus_one(lora_f32) -> None:
    _, ours, _ = lora_f32
    signature = ours.signature
    inputs = _steps([0, 1], None)[0]  # 8 rows: two blocks, no padding
    one = replace(inputs, token_ids=inputs.token_ids[:5]).with_optional(
        {LORA_SLOTS_INPUT: inputs.lora_slots[:5]}
    )
    *_, slots, counts = step_tensors(fill_absent(one, signature), signature)
    assert slots.tolist() == [[0, 0, 0, 0], [0, -1, -1, -1]] and counts.tolist() == [5, 8]
    *_, slots, _ = step_tensors(fill_absent(one.without(LORA_SLOTS_INPUT), signature), signature)
    assert (slots == -1).all() and slots.shape == (2, 4)
    with pytest.raises(ValueError, match="lora_slots has 8 rows, not one for each of the 5 tokens"):
        fill_absent(one.with_optional({LORA_SLOTS_INPUT: inputs.lora_slots}), signature)
    without_lora = StepSignature(tuple(i for i in signature.inputs if not i[0].startswith("lora")))
    assert (
        len(step_tensors(one.without("lora"), without_lora))
        == len(step_tensors(fill_absent(one, signature), signature)) - 1
    )


def test_tables_written_in_place_are_read_by_the_next_step(lora_f32) -> None:
    """The runtime loads an adapter by writing into its tables between steps: the executable never
    reads a copy. Zero tables give the base model's bits; the same arrays filled in, the adapters."""
    program, ours, _ = lora_f32
    reference = ReferenceExecutable(program.graph, program.weights)
    tables = ours.lora_spec.allocate(SLOTS, RANK)
    everyone = list(range(len(PROMPTS)))
    base = ours.step(
        _steps(everyone, None)[0].without(LORA_SLOTS_INPUT), ours.kv_cache_spec.allocate(16, BLOCK_SIZE)
    )
    zero = ours.step(_steps(everyone, tables)[0], ours.kv_cache_spec.allocate(16, BLOCK_SIZE))
    assert np.array_equal(zero, base)
    for name, table in _tables(ours.lora_spec, seed=2).items():
        tables[name][...] = table
    step = _steps(everyone, tables)[0]
    filled = ours.step(step, ours.kv_cache_spec.allocate(16, BLOCK_SIZE))
    expected = reference.step(step, reference.kv_cache_spec.allocate(16, BLOCK_SIZE))
    assert _relative_error(filled, expected) < TOLERANCE and not np.allclose(filled, base)


def test_the_manifest_records_the_tables_and_bad_ones_are_refused(lora_f32) -> None:
    program, ours, folder = lora_f32
    spec = LoRASpec.of_signature(StepSignature.of_graph(program.graph))
    assert spec is not None and ours.lora_spec == spec
    recorded = StepSignature.from_fields(json.loads((folder / DESCRIPTION).read_text())["signature"])
    assert LoRASpec.of_signature(recorded) == spec
    step = _steps([0, 1], None)[0]
    cache = ours.kv_cache_spec.allocate(16, BLOCK_SIZE)
    good = _tables(spec, seed=3)
    with pytest.raises(ValueError, match=r"lack lora_b\.down_proj"):
        ours.step(step.with_optional({k: v for k, v in good.items() if k != "lora_b.down_proj"}), cache)
    wrong = {**good, "lora_b.down_proj": np.zeros((2, SLOTS, RANK, 33), np.float32)}
    wants = r"lora_b\.down_proj is f32 \[2, 3, 4, 33\], the step wants f32 \[2, 3, 4, 32\]"
    with pytest.raises(BackendError, match=wants):
        ours.step(step.with_optional(wrong), cache)
    with pytest.raises(BackendError, match="lora_slots from 2 to 3: the tables hold 3"):
        ours.step(step.with_optional({**good, LORA_SLOTS_INPUT: step.lora_slots + 2}), cache)
    with pytest.raises(BackendError, match="the tables hold 1"):  # slots, but no tables: one zero slot
        ours.step(step, cache)


def test_a_replayed_decode_reads_the_tables_written_between_replays(lora_f32) -> None:
    """A decode step padded to its bucket (padding rows: slot -1) and replayed by a CUDA graph's
    stand-in: each replay gives the plain step's logits, also after the tables were written in place;
    other tables (another allocation) are another capture, holding them."""
    _, ours, _ = lora_f32
    everyone = list(range(len(PROMPTS)))
    tables = _tables(ours.lora_spec, seed=4)
    cache = as_torch(ours.kv_cache_spec.allocate(16, BLOCK_SIZE))
    ours.step(_steps(everyone, tables)[0], cache)
    plain_cache = cache.clone()

    def decode(step: int, given: dict[str, np.ndarray]) -> StepInputs:
        slices = [
            SequenceSlice([50 + i + step], len(PROMPTS[i]) + step, BLOCKS[i], lora_slot=ADAPTERS[i])
            for i in [0, 1, 3]
        ]
        return build_step_inputs(slices, BLOCK_SIZE, lora=True).with_optional(given)

    first = decode(0, tables)
    width = table_width(first.block_tables.shape[1])
    padded = pad_decode(first, decode_bucket(first), width, ours.signature.row_fills)
    assert padded.lora_slots.tolist() == [0, 1, 2, -1]
    graphs = DecodeGraphs(rerun_capture)
    ours.staging = InputStaging("cpu")  # a GPU executable's upload, here into host memory
    others = _tables(ours.lora_spec, seed=5)
    for step, given in enumerate([tables, tables, others, tables]):
        if step == 1:  # an adapter loaded into slot 1 between steps
            for name, table in others.items():
                tables[name][:, 1] = table[:, 1]
        expected = ours.step(decode(step, given), plain_cache)
        replayed = graphs.run(ours, ours.filled(decode(step, given)), cache)
        assert replayed is not None and torch.equal(replayed, torch.from_numpy(expected)), step
    assert torch.equal(cache, plain_cache)
    assert graphs.captured_buckets() == {4: 2}
    assert sorted(id(entry.owned["lora_a.q_proj"]) for entry in graphs.captured.values()) == sorted(
        id(t["lora_a.q_proj"]) for t in (tables, others)
    )


def test_the_cuda_step_run_on_the_cpu_matches_the_reference(lora_f32, tmp_path: Path) -> None:
    """Every CUDA kernel of the LoRA step (the lora kernel with its barrier among them), serialized and
    run on the CPU by the CPU runtime (gpu_on_cpu.py), against the reference."""
    program, _, _ = lora_f32
    ours = _gpu_on_cpu().cpu_executable_of_gpu_step(program, tmp_path)
    reference = ReferenceExecutable(program.graph, program.weights)
    tables = _tables(ours.lora_spec, seed=6)
    caches = [e.kv_cache_spec.allocate(16, BLOCK_SIZE) for e in (ours, reference)]
    for step in _steps(list(range(len(PROMPTS))), tables):
        mine, theirs = (e.step(step, cache) for e, cache in zip((ours, reference), caches, strict=True))
        assert _relative_error(mine, theirs) < TOLERANCE


def _has_nvcc() -> bool:
    try:
        cuda.find_nvcc()
    except BackendError:
        return False
    return True


@pytest.mark.skipif(not _has_nvcc(), reason="CUDA targets need nvcc (the CUDA toolkit)")
def test_the_lora_step_cross_compiles_for_hopper(lora_f32, tmp_path: Path) -> None:
    program, _, _ = lora_f32
    code = cuda.compile_cuda(program, Target("cuda", "sm_90"), tmp_path, CompileSettings())
    lines = cuda.check_cuda_library(tmp_path / cuda.LIBRARY, Target("cuda", "sm_90"))
    assert lines[0].startswith("step.so carries a cubin for sm_90")
    kernels = {name: origin for name, origin in code.kernels.items() if name.startswith("lora_")}
    assert len(kernels) == 4 and set(kernels.values()) == {"hand-written TIR"}  # q|k|v, o, gate|up, down
    recorded = json.loads((tmp_path / cuda.DESCRIPTION).read_text())["signature"]
    assert StepSignature.from_fields(recorded) == StepSignature.of_graph(
        program.graph, recorded["entry_points"], recorded["embedding_size"]
    )
