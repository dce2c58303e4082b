"""Compiling the same model with the same options twice gives byte-identical artifact folders on the TVM
backend (docs/ci.md), for this CPU and for a CUDA target cross-compiled without a GPU; and the pass that
puts VMShapeLower's shape-function stores in a fixed order (backends/tvm/reproducible.py)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import tirx

from kiln.backends.base import BackendError
from kiln.backends.tvm import cuda
from kiln.backends.tvm.reproducible import sort_shape_func_stores
from kiln.cli import main


def _has_nvcc() -> bool:
    try:
        cuda.find_nvcc()
    except BackendError:
        return False
    return True


def _elf_section(data: bytes, offset: int) -> str | None:
    """The name of the section of a little-endian ELF64 file that holds byte `offset`, if any."""
    if data[:5] != b"\x7fELF\x02" or len(data) < 64:
        return None
    shoff, _, _, _, _, shentsize, shnum, shstrndx = struct.unpack_from("<QIHHHHHH", data, 0x28)

    def header(index: int) -> tuple[int, int, int, int]:
        name, kind, _, _, start, size = struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)
        return name, kind, start, size

    names_at = header(shstrndx)[2]
    for index in range(1, shnum):
        name, kind, start, size = header(index)
        if kind != 8 and start <= offset < start + size:  # 8: SHT_NOBITS, no bytes in the file
            return data[names_at + name : data.index(b"\0", names_at + name)].decode()
    return None


def first_difference(first: Path, second: Path) -> str | None:
    """None if the two folders hold the same files with the same bytes; else the first difference: the
    file, and the byte offset (with its ELF section, for a library) where the two copies part."""
    names = [
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        for root in (first, second)
    ]
    if names[0] != names[1]:
        only_first, only_second = sorted(set(names[0]) - set(names[1])), sorted(set(names[1]) - set(names[0]))
        return f"different files: only in the first {only_first}, only in the second {only_second}"
    for name in names[0]:
        one, two = (first / name).read_bytes(), (second / name).read_bytes()
        if one == two:
            continue
        common = min(len(one), len(two))
        differing = np.flatnonzero(
            np.frombuffer(one[:common], np.uint8) != np.frombuffer(two[:common], np.uint8)
        )
        offset = int(differing[0]) if differing.size else common
        sections = list(dict.fromkeys(_elf_section(one, int(at)) or "?" for at in differing))
        where = f" (ELF sections that differ: {', '.join(sections)})" if one.startswith(b"\x7fELF") else ""
        sizes = f"sizes {len(one)}, {len(two)}"
        return f"{name}: first differing byte at offset {offset} (0x{offset:x}){where}; {sizes}"
    return None


def _compile(model: Path, out: Path, target: str, in_process: bool) -> None:
    args = ["compile", str(model), "--backend", "tvm", "--target", target, "-o", str(out), "--quiet"]
    if in_process:
        assert main(args) == 0
    else:
        done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "target",
    [
        "cpu",
        pytest.param(
            "cuda:sm_90",
            marks=pytest.mark.skipif(not _has_nvcc(), reason="CUDA targets need nvcc (the CUDA toolkit)"),
        ),
    ],
)
def test_compiling_twice_gives_byte_identical_folders(target: str, tmp_path: Path, tiny_hf) -> None:
    """One compile in a fresh process, one in this one (after whatever this session compiled before): TVM's
    order of a shape function's stores depended on object addresses, which both change."""
    tiny_hf("qwen2", tmp_path / "hf")
    first, second = tmp_path / "first", tmp_path / "second"
    _compile(tmp_path / "hf", first, target, in_process=False)
    _compile(tmp_path / "hf", second, target, in_process=True)
    manifests = [json.loads((folder / "manifest.json").read_text()) for folder in (first, second)]
    library = f"{target.replace(':', '-')}/step.so"
    assert library in manifests[0]["files"], sorted(manifests[0]["files"])
    assert first_difference(first, second) is None, first_difference(first, second)
    assert manifests[0] == manifests[1]  # implied by the bytes, kept for the message if not


def _heap_store(heap: tirx.Buffer, slot: int, factor: int) -> tirx.BufferStore:
    index = tvm.tirx.IntImm("int64", slot)
    load = tirx.BufferLoad(heap, [tvm.tirx.IntImm("int64", 0)])
    return tirx.BufferStore(heap, load * tvm.tirx.IntImm("int64", factor), [index])


def test_shape_func_stores_are_put_in_slot_order() -> None:
    heap = tirx.decl_buffer((5,), "int64", "H")
    stores = [_heap_store(heap, slot, factor) for slot, factor in ((3, 8), (1, 2), (4, 16), (2, 4))]
    func = tirx.PrimFunc([heap], tirx.SeqStmt(stores))
    module = tvm.IRModule({"shape_func": func, "shape_func1": func.with_body(stores[0]), "split": func})
    result = sort_shape_func_stores(module)
    slots = [int(stmt.indices[0].value) for stmt in result["shape_func"].body.seq]
    assert slots == [1, 2, 3, 4]
    assert result["shape_func1"].body.same_as(stores[0])  # one store: nothing to order
    assert [int(stmt.indices[0].value) for stmt in result["split"].body.seq] == [
        3,
        1,
        4,
        2,
    ]  # not a shape_func
    assert [int(stmt.indices[0].value) for stmt in module["shape_func"].body.seq] == [
        3,
        1,
        4,
        2,
    ]  # input kept
