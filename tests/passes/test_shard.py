"""GGUF blocks through the shard pass (passes/shard.py): each rank's blocks are cut as its weights are
(whole rows of blocks for column-parallel slices, whole blocks of each row for row-parallel ones), so
they dequantize to exactly the rank's float weights; a cut through a block is refused, naming the
numbers. (The split itself: tests/backends/reference/test_tensor_parallel.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.frontend.capture import capture_weights
from kiln.frontend.source import QuantizedTensor
from kiln.ir import Program
from kiln.passes.base import PassError
from kiln.passes.shard import shard_with_blocks

GGML_TYPE = "Q5_0"  # 32-element blocks


def _blocks_and_weights(tiny_llama, random_gguf_blocks, skip: str | None) -> tuple[dict, dict]:
    config, weights = tiny_llama
    blocks = {}
    for index, (name, tensor) in enumerate(sorted(weights.items())):
        if tensor.dim() != 2 or (skip is not None and skip in name):
            continue
        rows, k = tensor.shape
        held = random_gguf_blocks(GGML_TYPE, rows, k, seed=index, edges=False)
        blocks[name] = QuantizedTensor(GGML_TYPE, (rows, k), held)
        weights = {**weights, name: QuantizedTensor(GGML_TYPE, (rows, k), held).dequantize()}
    return config, weights, blocks


def test_each_ranks_blocks_dequantize_to_its_weights(tiny_llama, random_gguf_blocks) -> None:
    # at TP 2 o_proj's 32 input features split into 16 a rank, less than a block: it stays float here
    world = 2
    config, weights, blocks = _blocks_and_weights(tiny_llama, random_gguf_blocks, skip="o_proj")
    captured = capture_weights(config, weights)
    for rank in range(world):
        program, cut = shard_with_blocks(Program(captured.graph, captured.weights), world, rank, blocks)
        assert cut and set(cut) <= set(program.weights)
        for name, held in cut.items():
            assert held.shape == tuple(program.weights[name].shape)
            assert torch.equal(held.dequantize(), program.weights[name]), (rank, name)
        row_parallel = [name for name in cut if "down_proj" in name]
        assert row_parallel and all(cut[n].read().shape[1] < blocks[n].read().shape[1] for n in row_parallel)


def test_a_cut_through_a_block_is_refused(tiny_llama, random_gguf_blocks) -> None:
    config, weights, blocks = _blocks_and_weights(tiny_llama, random_gguf_blocks, skip=None)
    captured = capture_weights(config, weights)
    before = {name: (held.shape, held.read()) for name, held in blocks.items()}
    with pytest.raises(PassError, match=r"o_proj.weight \(Q5_0\) at tensor-parallel size 2: each rank's 16"):
        shard_with_blocks(Program(captured.graph, captured.weights), 2, 0, blocks)
    # the source is not changed: the same tensors, of the same shapes, holding the same bytes
    assert blocks.keys() == before.keys()
    for name, (shape, data) in before.items():
        assert blocks[name].shape == shape and np.array_equal(blocks[name].read(), data), name
