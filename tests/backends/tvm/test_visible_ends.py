"""The compiled step's visible_ends input (ir/step.py VISIBLE_ENDS_INPUT), on the tiny Llama with the
input read by its paged_attention nodes (conftest.py): a prefill whose "image" rows see their image's
later tokens, and steps given none (each row's position + 1), through `step` and `decode`, against
the reference backend; the artifact's record of the input, and an artifact from before the record; a
decode step padded to a CUDA-graph bucket and replayed (a stand-in for the graph, on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.backends.base import BackendError
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import DESCRIPTION, TVMBackend
from kiln.backends.tvm.cuda_graphs import DecodeGraphs, decode_bucket, pad_decode, table_width
from kiln.backends.tvm.staging import InputStaging
from kiln.ir import Program
from kiln.ir.host_arrays import as_torch
from kiln.ir.step import VISIBLE_ENDS_INPUT, SequenceSlice, StepInputs, StepSignature, build_step_inputs
from tests.backends.tvm.replay_stand_in import rerun_capture

BLOCK_SIZE = 4
TOLERANCE = 1e-4  # max |tvm - reference| / max |reference|
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]  # 13 token rows: 3 rows of padding
TABLES = [[1, 2, 3, 7], [4, 5]]
IMAGE = slice(2, 7)  # the first prompt's rows 2 .. 6 see each other both ways


@pytest.fixture(scope="module")
def compiled(visible_ends_program: Program, tmp_path_factory: pytest.TempPathFactory, tvm_compile):
    folder = tmp_path_factory.mktemp("tvm-visible-ends")
    return folder, tvm_compile(visible_ends_program, folder)


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _prefill() -> StepInputs:
    slices = [SequenceSlice(p, 0, t, logits_at=range(len(p))) for p, t in zip(PROMPTS, TABLES, strict=True)]
    causal = build_step_inputs(slices, BLOCK_SIZE)
    ends = causal.positions + 1
    ends[IMAGE] = ends[IMAGE][-1]
    return causal.with_optional({VISIBLE_ENDS_INPUT: ends})


def _decode(step: int, ends: bool) -> StepInputs:
    decode = build_step_inputs(
        [
            SequenceSlice([20 + i + step], len(p) + step, t)
            for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))
        ],
        BLOCK_SIZE,
    )
    return decode.with_optional({VISIBLE_ENDS_INPUT: decode.positions + 1 if ends else None})


def test_steps_with_and_without_visible_ends_match_the_reference(visible_ends_program, compiled) -> None:
    _, tvm = compiled
    reference = ReferenceExecutable(visible_ends_program.graph, visible_ends_program.weights)
    ours, theirs = (e.kv_cache_spec.allocate(8, BLOCK_SIZE) for e in (tvm, reference))
    prefill = _prefill()
    logits = tvm.step(prefill, ours)
    assert _relative_error(logits, reference.step(prefill, theirs)) < TOLERANCE
    causal = tvm.step(prefill.without(VISIBLE_ENDS_INPUT), tvm.kv_cache_spec.allocate(8, BLOCK_SIZE))
    assert not np.allclose(logits[IMAGE], causal[IMAGE]), "the image's rows saw its later tokens"
    # the rows that see no image row, in either layer: the causal step's bits
    text = np.r_[: IMAGE.start, len(PROMPTS[0]) : len(logits)]
    assert np.array_equal(logits[text], causal[text])
    for step in range(2):  # `decode` (one row block): visible_ends given, then none
        decode = _decode(step, ends=step == 0)
        assert _relative_error(tvm.step(decode, ours), reference.step(decode, theirs)) < TOLERANCE, step
    assert _relative_error(ours, theirs) < TOLERANCE  # the K/V the layers wrote


def test_the_artifact_records_visible_ends_and_one_without_the_record_is_refused(
    compiled, tiny_llama_program, tmp_path: Path, tvm_compile
) -> None:
    folder, _ = compiled
    recorded = StepSignature.from_fields(json.loads((folder / DESCRIPTION).read_text())["signature"])
    assert recorded.takes(VISIBLE_ENDS_INPUT)
    tvm_compile(tiny_llama_program, tmp_path)
    description = json.loads((tmp_path / DESCRIPTION).read_text())
    assert not StepSignature.from_fields(description["signature"]).takes(VISIBLE_ENDS_INPUT)
    text_model = TVMBackend().load(tmp_path, tiny_llama_program.weights, Target("cpu"))
    del description["signature"]
    (tmp_path / DESCRIPTION).write_text(json.dumps(description))  # as written before the record
    with pytest.raises(BackendError, match="did not record the step's signature"):
        TVMBackend().load(tmp_path, tiny_llama_program.weights, Target("cpu"))
    reference = ReferenceExecutable(tiny_llama_program.graph, tiny_llama_program.weights)
    prefill = _prefill().without(VISIBLE_ENDS_INPUT)
    ours, theirs = (e.step(prefill, e.kv_cache_spec.allocate(8, BLOCK_SIZE)) for e in (text_model, reference))
    assert _relative_error(ours, theirs) < TOLERANCE


def test_padded_and_replayed_decode_steps_pass_visible_ends(compiled) -> None:
    """A decode step padded to its bucket keeps each row's end (its padding rows get 1), and a graph
    captured with visible_ends is refilled with each step's (given, or each position + 1)."""
    _, tvm = compiled
    cache = as_torch(tvm.kv_cache_spec.allocate(8, BLOCK_SIZE))
    tvm.step(_prefill().without(VISIBLE_ENDS_INPUT), cache)
    decode = _decode(0, ends=True)
    bucket = decode_bucket(decode)
    assert bucket == 4
    padded = pad_decode(decode, bucket, table_width(decode.block_tables.shape[1]), tvm.signature.row_fills)
    assert padded.visible_ends is not None and padded.visible_ends.tolist() == [*decode.visible_ends, 1, 1]
    plain_cache = cache.clone()
    graphs = DecodeGraphs(rerun_capture)
    tvm.staging = InputStaging("cpu")  # a GPU executable's upload, here into host memory
    for step in range(3):
        decode = _decode(step, ends=step != 1)
        expected = tvm.step(decode, plain_cache)
        replayed = graphs.run(tvm, tvm.filled(decode), cache)
        assert replayed is not None and torch.equal(replayed, torch.from_numpy(expected)), step
    assert torch.equal(cache, plain_cache)
    assert graphs.captured_buckets() == {4: 1}
