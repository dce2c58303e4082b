"""CUDA-graph replay of decode steps, checked on the CPU: a decode step padded to a bucket of sequences
and wider block tables gives the same logits and cache writes as the step itself; with a stand-in for
the graph (replay re-runs the step into the captured output buffer), replayed steps match plain ones,
each result is a copy the next replay leaves alone, and a capture is keyed by everything it baked in.
(Capture and replay on a GPU need one and have not run here.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kiln.backends.base import BackendError
from kiln.backends.tvm.cuda_graphs import (
    DECODE_BUCKETS,
    Captured,
    DecodeGraphs,
    GraphKey,
    decode_bucket,
    graph_key,
    pad_decode,
    table_width,
)
from kiln.backends.tvm.staging import InputStaging
from kiln.ir import DTYPES
from kiln.ir.host_arrays import as_torch
from kiln.ir.step import SequenceSlice, build_step_inputs

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_tvm(tmp_path_factory, tvm_compile, tiny_llama_program):
    return tvm_compile(tiny_llama_program, tmp_path_factory.mktemp("tvm"))


def test_buckets_and_widths() -> None:
    decode = build_step_inputs([SequenceSlice([5], 3, [1]), SequenceSlice([6], 7, [2, 3])], BLOCK_SIZE)
    assert decode_bucket(decode) == 4 and DECODE_BUCKETS[0] == 1
    prefill = build_step_inputs([SequenceSlice([5, 6], 0, [1])], BLOCK_SIZE)
    assert decode_bucket(prefill) is None
    assert [table_width(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]


def test_padded_decode_step_gives_the_same_logits(tiny_tvm) -> None:
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    tables = [[1, 2], [3], [4, 5, 6]]
    cache = tiny_tvm.kv_cache_spec.allocate(8, BLOCK_SIZE)
    tiny_tvm.step(
        build_step_inputs([SequenceSlice(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BLOCK_SIZE),
        cache,
    )
    decode = build_step_inputs(
        [SequenceSlice([20 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))],
        BLOCK_SIZE,
    )
    bucket = decode_bucket(decode)
    assert bucket == 4
    padded = pad_decode(
        decode, bucket, table_width(decode.block_tables.shape[1]) * 2, tiny_tvm.signature.row_fills
    )
    plain_cache, padded_cache = (tiny_tvm.kv_cache_spec.allocate(8, BLOCK_SIZE) for _ in range(2))
    plain_cache[...], padded_cache[...] = cache, cache  # copies where the kernels want them (aligned)
    plain = tiny_tvm.step(decode, plain_cache)
    replayed = tiny_tvm.step(padded, padded_cache)[: len(prompts)]
    assert np.array_equal(plain, replayed)
    assert np.array_equal(plain_cache, padded_cache)


class _Rerun:
    """A CUDA graph's stand-in on the CPU: replay runs the captured step again into the same output
    buffer, as a graph's replay rewrites its static output."""

    def __init__(self, executable, tensors: list[torch.Tensor], kv_cache: torch.Tensor, logits: torch.Tensor):
        self.executable, self.tensors, self.kv_cache, self.logits = executable, tensors, kv_cache, logits

    def replay(self) -> None:
        self.logits.copy_(torch.from_dlpack(self.executable.call(self.tensors, self.kv_cache)))


def _rerun_capture(captures: list[GraphKey]):
    def capture(executable, host: list[np.ndarray], kv_cache: torch.Tensor) -> Captured:
        tensors = [torch.from_numpy(a.copy()) for a in host]
        logits = torch.from_dlpack(executable.call(tensors, kv_cache)).clone()
        captures.append(graph_key(tensors[3].shape[0], tensors[3].shape[1], kv_cache))
        return Captured(_Rerun(executable, tensors, kv_cache, logits), tensors, logits, kv_cache)

    return capture


def _decode(prompts: list[list[int]], tables: list[list[int]], step: int):
    return build_step_inputs(
        [
            SequenceSlice([20 + i + step], len(p) + step, t)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ],
        BLOCK_SIZE,
    )


def test_replayed_decode_steps_match_plain_steps_and_are_copied_out(tiny_tvm) -> None:
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    tables = [[1, 2, 7], [3, 8], [4, 5, 6]]
    cache = as_torch(tiny_tvm.kv_cache_spec.allocate(9, BLOCK_SIZE))  # a GPU's cache is a tensor
    tiny_tvm.step(
        build_step_inputs([SequenceSlice(p, 0, t) for p, t in zip(prompts, tables, strict=True)], BLOCK_SIZE),
        cache,
    )
    plain_cache = cache.clone()
    captures: list[GraphKey] = []
    graphs = DecodeGraphs(_rerun_capture(captures))
    tiny_tvm.staging = InputStaging("cpu")  # a GPU executable's upload, here into host memory
    replayed = []
    for step in range(3):
        decode = _decode(prompts, tables, step)
        expected = tiny_tvm.step(decode, plain_cache)
        logits = graphs.run(tiny_tvm, decode, cache)
        assert logits is not None and torch.equal(logits, torch.from_numpy(expected)), step
        replayed.append((logits, logits.clone()))
    assert all(torch.equal(held, kept) for held, kept in replayed)  # later replays left them alone
    assert torch.equal(cache, plain_cache)
    assert captures == [graph_key(4, 4, cache)]  # one capture: same bucket, width and cache
    graphs.require(3)  # what scripts/gpu_bundle.py asks before timing replays
    assert graphs.captured_buckets() == {4: 1}
    with pytest.raises(RuntimeError, match=r"no CUDA graph was captured for 16 decode rows \(bucket 16\)"):
        graphs.require(16)


def test_a_failed_capture_runs_plain_steps_and_fails_the_check(tiny_tvm) -> None:
    """A capture that always fails leaves every step correct (plain calls), but `require`, which the GPU
    check and test call, says so: graphs and no graphs never pass for the same thing."""
    prompts, tables = [[3, 4, 5]], [[1, 2]]
    cache = as_torch(tiny_tvm.kv_cache_spec.allocate(4, BLOCK_SIZE))
    tiny_tvm.step(build_step_inputs([SequenceSlice(prompts[0], 0, tables[0])], BLOCK_SIZE), cache)

    def refused(*_: object) -> Captured:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = DecodeGraphs(refused)
    tiny_tvm.staging = InputStaging("cpu")
    with pytest.warns(UserWarning, match="CUDA graph capture failed"):
        assert graphs.run(tiny_tvm, _decode(prompts, tables, 0), cache) is None
    assert graphs.run(tiny_tvm, _decode(prompts, tables, 1), cache) is None  # off from now on
    with pytest.raises(RuntimeError, match="capture failed: RuntimeError: operation not permitted"):
        graphs.require()


def test_the_key_holds_the_cache_and_tells_its_shape() -> None:
    cache = torch.zeros(2, 8, 4, 2, 16)
    same_memory = cache.view(2, 8, 8, 16)
    assert graph_key(4, 2, cache) != graph_key(4, 2, same_memory)
    assert graph_key(4, 2, cache) != graph_key(4, 2, cache.to(torch.float16))
    assert graph_key(4, 2, cache) != graph_key(16, 2, cache) != graph_key(4, 4, cache)
    assert graph_key(4, 2, cache) == graph_key(4, 2, cache)
    assert "kv_cache" in Captured.__dataclass_fields__  # a capture keeps its cache, so the address stays its


def test_decode_steps_whose_logits_rows_are_not_in_order_are_not_replayed() -> None:
    decode = build_step_inputs([SequenceSlice([5], 3, [1]), SequenceSlice([6], 7, [2, 3])], BLOCK_SIZE)
    assert decode_bucket(decode) == 4
    swapped = replace(decode, logits_indices=decode.logits_indices[::-1].copy())
    assert decode_bucket(swapped) is None


def test_a_cache_elsewhere_than_the_executable_reads_it_is_refused(tiny_tvm) -> None:
    assert tiny_tvm.kv_cache_device == "cpu"
    shape = tiny_tvm.kv_cache_spec.allocate(2, BLOCK_SIZE).shape
    elsewhere = torch.zeros(shape, dtype=DTYPES[tiny_tvm.kv_cache_spec.dtype], device="meta")
    decode = build_step_inputs([SequenceSlice([5], 0, [1])], BLOCK_SIZE)
    with pytest.raises(BackendError, match="the KV cache is on meta; this executable reads it on cpu"):
        tiny_tvm.step(decode, elsewhere)
