"""The decode-bucket padding behind CUDA-graph replay, checked on the CPU: a decode step padded to a
bucket of sequences and wider block tables gives the same logits and cache writes as the step itself.
(Capture and replay need a GPU and have not run here.)"""

from __future__ import annotations

import pytest
import torch

from kiln.backends.tvm.cuda_graphs import DECODE_BUCKETS, decode_bucket, pad_decode, table_width
from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

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
    padded = pad_decode(decode, bucket, table_width(decode.block_tables.shape[1]) * 2)
    plain_cache, padded_cache = cache.clone(), cache.clone()
    plain = tiny_tvm.step(decode, plain_cache)
    replayed = tiny_tvm.step(padded, padded_cache)[: len(prompts)]
    assert torch.equal(plain, replayed)
    assert torch.equal(plain_cache, padded_cache)
