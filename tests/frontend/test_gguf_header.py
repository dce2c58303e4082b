"""The header skim names the same tensor types as gguf's reader, and refuses a broken file clearly."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from kiln.errors import ModelLoadError
from kiln.frontend.gguf_header import bytes_by_type, gguf_tensor_types, gguf_tensors


def test_the_tensors_of_a_real_gguf_are_the_readers(smollm2_gguf_path: Path) -> None:
    tensors = gguf.GGUFReader(smollm2_gguf_path).tensors
    assert gguf_tensor_types(smollm2_gguf_path) == [tensor.tensor_type.name for tensor in tensors]
    assert [entry.num_bytes for entry in gguf_tensors(smollm2_gguf_path)] == [int(t.n_bytes) for t in tensors]
    assert list(bytes_by_type(smollm2_gguf_path)) == ["Q4_1", "Q8_0", "F32"]


def test_every_kind_of_metadata_value_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_bool("test.flag", True)
    writer.add_uint8("test.u8", 7)
    writer.add_float64("test.f64", 0.5)
    writer.add_array("test.strings", ["a", "bc", ""])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_tensor("a", np.zeros((2, 3), dtype=np.float32))
    writer.add_tensor("b", np.zeros((4,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_tensor_types(path) == ["F32", "F16"]
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        gguf_tensor_types(path)
