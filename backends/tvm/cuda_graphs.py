"""Decode steps on a GPU replayed as CUDA graphs, one per decode bucket.

A decode step (every sequence computes one token and wants its logits, in order) is padded to a
bucket of sequences (1, 4, 16, 64) and its block tables to a power-of-two width: empty sequences own
no query rows, so their rows are zeros and their logits are dropped. The first step of a bucket runs
once to warm the VM's memory pool, then is captured into a `torch.cuda.CUDAGraph` through
`tvm_ffi.use_torch_stream`; later steps of that bucket upload their inputs (one copy from pinned
memory, staging.py), copy them into the captured buffers on the device, replay it and copy the
logits out (the next replay overwrites the captured output). A capture is keyed by everything it
baked in: the bucket, the table width, the KV cache (address, shape, dtype, device) and, for a model
compiled with LoRA, the step's LoRA tables (their addresses and shapes: the runtime allocates them
once and writes adapters into them in place, which a replay then reads), and it holds the cache and
the tables so those addresses cannot be reused by another tensor; padding sequences get LoRA slot
-1. This is the only capture mechanism: the build does not run Relax's RewriteCUDAGraph, whose
captures would nest inside this one. Any capture failure turns graphs off for the executable, with
a warning, and steps run as plain calls.

Written without a GPU: keys, padding and the copy-out are tested on the CPU with a stand-in for the
graph that re-runs the step into the same output buffer (tests/backends/tvm/test_cuda_graphs.py);
capture and replay on a GPU have never run. KILN_CUDA_GRAPHS=0 turns them off.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from kiln.ir import StepInputs
from kiln.ir.step import IndexArray

DECODE_BUCKETS = (1, 4, 16, 64)


def cuda_graphs_enabled() -> bool:
    return os.environ.get("KILN_CUDA_GRAPHS", "1") != "0"


def decode_bucket(inputs: StepInputs) -> int | None:
    """The bucket of a decode step (one token and one logits row per sequence, in order), None otherwise."""
    sequences = inputs.seq_lens.shape[0]
    if inputs.token_ids.shape[0] != sequences or inputs.logits_indices.shape[0] != sequences:
        return None
    in_order = np.arange(sequences + 1, dtype=np.int64)
    if not np.array_equal(inputs.query_start_loc, in_order):
        return None
    if not np.array_equal(inputs.logits_indices, in_order[:-1]):  # pad_decode asks for row i's
        return None
    return next((bucket for bucket in DECODE_BUCKETS if bucket >= sequences), None)


def table_width(blocks: int) -> int:
    return 1 << max(0, (blocks - 1).bit_length())


def pad_decode(inputs: StepInputs, bucket: int, width: int, row_fills: Mapping[str, int]) -> StepInputs:
    """The step with `bucket` sequences and block tables `width` wide; the extra sequences are empty (a
    row input's padding rows hold its `row_fills` value)."""
    sequences = inputs.seq_lens.shape[0]
    extra = bucket - sequences

    def padded(array: IndexArray, fill: int) -> IndexArray:
        return np.concatenate((array, np.full(extra, fill, dtype=np.int64)))

    tables = np.zeros((bucket, width), dtype=np.int64)
    tables[:sequences, : inputs.block_tables.shape[1]] = inputs.block_tables
    return replace(
        inputs,
        token_ids=padded(inputs.token_ids, 0),
        positions=padded(inputs.positions, 0),
        slot_mapping=padded(inputs.slot_mapping, -1),
        block_tables=tables,
        seq_lens=padded(inputs.seq_lens, 0),
        query_start_loc=padded(inputs.query_start_loc, sequences),
        logits_indices=np.arange(bucket, dtype=np.int64),
        optional={
            name: padded(array, row_fills[name]) if name in row_fills else array
            for name, array in inputs.optional.items()
        },
    )


@dataclass(frozen=True)
class GraphKey:
    """What a captured decode graph baked in: replaying it for anything else would be wrong."""

    bucket: int
    width: int
    cache_address: int
    cache_shape: tuple[int, ...]
    cache_dtype: torch.dtype
    cache_device: str
    owned: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (address, shape) of each runtime-owned input


def graph_key(
    bucket: int, width: int, kv_cache: torch.Tensor, owned: Mapping[str, Any] | None = None
) -> GraphKey:
    """`owned`: the step's runtime-owned inputs (LoRA tables), by name."""
    tables = tuple((_address(t), tuple(t.shape)) for _, t in sorted((owned or {}).items()))
    cache = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype, str(kv_cache.device))
    return GraphKey(bucket, width, *cache, tables)


def _address(table: Any) -> int:
    """A runtime-owned input's data address: a tensor's (a GPU's), an array's (CPU stand-ins)."""
    return int(table.ctypes.data) if isinstance(table, np.ndarray) else int(table.data_ptr())


class Replayable(Protocol):
    def replay(self) -> None: ...


@dataclass
class Captured:
    graph: Replayable  # torch.cuda.CUDAGraph on a GPU
    tensors: list[torch.Tensor]  # the captured input buffers, refilled before each replay
    logits: torch.Tensor  # the captured output buffer, overwritten by each replay
    kv_cache: torch.Tensor  # held so that its address, part of the key, is not reused
    owned: Mapping[str, Any] | None = None  # the runtime-owned inputs, held likewise (set by run)


Capture = Callable[[Any, list[IndexArray], torch.Tensor], Captured]


def capture_cuda_graph(executable: Any, host: list[IndexArray], kv_cache: torch.Tensor) -> Captured:
    tensors = [torch.from_numpy(array).to(kv_cache.device) for array in host]
    executable.call(tensors, kv_cache)  # warm-up: the VM's pool holds every buffer the step needs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with executable.ffi.use_torch_stream(torch.cuda.graph(graph)):
        logits = torch.from_dlpack(executable.call(tensors, kv_cache))
    torch.cuda.synchronize()
    return Captured(graph, tensors, logits, kv_cache)


class DecodeGraphs:
    def __init__(self, capture: Capture = capture_cuda_graph) -> None:
        self.captured: dict[GraphKey, Captured] = {}
        self.enabled = True
        self.failure: str | None = None  # why a capture failed (graphs are then off)
        self._capture = capture

    def captured_buckets(self) -> dict[int, int]:
        """Decode bucket (rows) → graphs captured for it."""
        counts: dict[int, int] = {}
        for key in self.captured:
            counts[key.bucket] = counts.get(key.bucket, 0) + 1
        return counts

    def require(self, rows: int | None = None) -> None:
        """Raise unless graphs are on, no capture failed and (given `rows`) the decode bucket of that many
        rows has a graph: a check for a GPU run that means to time or test replays, not plain calls."""
        if self.failure is not None:
            raise RuntimeError(f"CUDA graph capture failed: {self.failure}")
        if not self.enabled:
            raise RuntimeError("CUDA graphs are off")
        if rows is not None:
            bucket = next((b for b in DECODE_BUCKETS if b >= rows), None)
            if bucket not in self.captured_buckets():
                raise RuntimeError(
                    f"no CUDA graph was captured for {rows} decode rows (bucket {bucket}); "
                    f"captured: {self.captured_buckets() or 'none'}"
                )

    def run(self, executable: Any, inputs: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Logits of a decode step by graph replay (a tensor of their own); None when the step is
        not a decode bucket or graphs are off."""
        bucket = decode_bucket(inputs)
        if not self.enabled or bucket is None:
            return None
        width = table_width(inputs.block_tables.shape[1])
        signature = executable.signature
        padded = pad_decode(inputs, bucket, width, signature.row_fills)
        host = executable.step_tensors(padded)
        owned = {name: a for name, a in inputs.optional.items() if signature.runtime_owned(name)}
        key = graph_key(bucket, width, kv_cache, owned)
        entry = self.captured.get(key)
        if entry is None:
            try:
                # a LoRA model's call passes the tables the executable's step set: this step's
                entry = self._capture(executable, host, kv_cache)
            except Exception as error:  # a driver or TVM refusal: run without graphs from now on
                warnings.warn(f"CUDA graph capture failed, running without graphs: {error}", stacklevel=2)
                self.enabled = False
                self.failure = f"{type(error).__name__}: {error}"
                return None
            entry.owned = owned or None
            self.captured[key] = entry
        for buffer, tensor in zip(entry.tensors, executable.upload(host), strict=True):
            buffer.copy_(tensor)
        entry.graph.replay()
        return entry.logits[: inputs.seq_lens.shape[0]].clone()
