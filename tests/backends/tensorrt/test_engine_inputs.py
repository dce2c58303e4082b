"""What the TensorRT engine build is given, checked without TensorRT: bfloat16 weights as
initializers, a model written with its weights as external data (so models over protobuf's 2 GB parse),
and the optimisation profile's ranges from the artifact's limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.backends.base import CompileSettings
from kiln.backends.tensorrt.engine import (
    BLOCK_SIZE,
    MAX_CACHE_BLOCKS,
    _profile_shapes,
    initializer,
    write_for_parser,
)


def test_bfloat16_weights_become_bfloat16_initializers_bit_for_bit() -> None:
    weight = torch.randn(3, 5).to(torch.bfloat16)
    proto = initializer("w", weight)
    assert proto.data_type == TensorProto.BFLOAT16 and list(proto.dims) == [3, 5]
    assert proto.raw_data == weight.view(torch.int16).numpy().tobytes()
    as_float = np.asarray(numpy_helper.to_array(proto), dtype=np.float32)
    assert np.array_equal(as_float, weight.to(torch.float32).numpy())
    float_proto = initializer("f", torch.ones(2, dtype=torch.float16))
    assert float_proto.data_type == TensorProto.FLOAT16


def test_the_model_goes_to_the_parser_with_its_weights_beside_it(tmp_path: Path) -> None:
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 64])],
        [numpy_helper.from_array(weight, "w")],
    )
    path = write_for_parser(helper.make_model(graph), tmp_path)
    assert path.stat().st_size < weight.nbytes  # the weights are not in the protobuf
    assert (tmp_path / "weights.bin").stat().st_size == weight.nbytes
    loaded = onnx.load(str(path))
    assert np.array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), weight)


def test_profile_ranges_come_from_the_limits() -> None:
    settings = CompileSettings(max_num_seqs=8, max_model_len=4096)
    dims = _profile_shapes(settings)
    per_sequence = 4096 // BLOCK_SIZE
    assert dims["NB"] == (2, 8 * per_sequence + 1, MAX_CACHE_BLOCKS)  # any cache the engine may size
    assert dims["MB"][2] == per_sequence and dims["B"][2] == 8 and dims["T"][2] == 4096
    for low, opt, high in dims.values():
        assert low <= opt <= high
    huge = _profile_shapes(CompileSettings(max_num_seqs=256, max_model_len=131072))
    assert huge["NB"][1] <= huge["NB"][2] == MAX_CACHE_BLOCKS
