"""A weight in llama.cpp's GGUF block layout (Q4_K, Q8_0, ...), as loaders find it and quantization
passes import it: unread until asked, so a compile holds one tensor's blocks at a time."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from kiln.ir.deferred import Deferred
from kiln.ir.mapped import let_go

ROWS_AT_ONCE = 4096  # rows dequantized together: bounds the temporaries of a large tensor


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight kept in its GGUF block layout, so quantization passes can import it as is.

    `shape` is in torch order ([out_features, in_features] for a linear weight); `blocks` are the raw
    GGUF bytes, one row of blocks per output row: usually a view of the mapped file, read only when
    `read()` is called, or a function that makes them then (a pre-quantized HF checkpoint's groups
    repacked as blocks: frontend/hf_quantization.py). `row_order`: the output rows are `blocks`' rows in
    this order (llama.cpp's Q/K permutation undone without copying).
    """

    ggml_type: str  # "Q4_0", "Q4_1", "Q8_0", "Q4_K", ... (gguf_loader.QUANTIZED_TYPES)
    shape: tuple[int, ...]
    blocks: np.ndarray | Callable[[], np.ndarray]  # uint8 [rows, bytes a row]
    row_order: np.ndarray | None = None
    origin: str | None = None  # what the model file stores, where that is not these blocks

    def read(self) -> np.ndarray:
        """The blocks in memory, rows in order (the mapped file's pages are let go after copying)."""
        blocks = self.blocks() if callable(self.blocks) else self.blocks
        rows = blocks if self.row_order is None else blocks[self.row_order]
        copy = np.array(rows, dtype=np.uint8, copy=True)
        let_go(blocks)
        return copy

    def rows(self, start: int, stop: int) -> QuantizedTensor:
        """Output rows [start, stop) (still unread)."""
        shape = (stop - start, *self.shape[1:])
        if self.row_order is None and not callable(self.blocks):
            return QuantizedTensor(self.ggml_type, shape, self.blocks[start:stop], None, self.origin)
        order = np.arange(self.shape[0]) if self.row_order is None else self.row_order
        return QuantizedTensor(self.ggml_type, shape, self.blocks, order[start:stop], self.origin)

    def columns(self, start: int, stop: int) -> QuantizedTensor:
        """Input features [start, stop) of every row, on block boundaries (ValueError where not)."""
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml_type]]
        if start % block_size or stop % block_size:
            raise ValueError(f"columns {start}..{stop} do not start and end on {block_size}-element blocks")
        first, last = start // block_size * block_bytes, stop // block_size * block_bytes
        blocks = self.blocks
        cut = (lambda: blocks()[:, first:last]) if callable(blocks) else blocks[:, first:last]
        shape = (*self.shape[:-1], stop - start)
        return QuantizedTensor(self.ggml_type, shape, cut, self.row_order, self.origin)

    def dequantize(self) -> torch.Tensor:
        """Float32 values, bit-identical to `gguf.quants.dequantize`."""
        qtype = gguf.GGMLQuantizationType[self.ggml_type]
        blocks = self.read()
        values = torch.empty((blocks.shape[0], math.prod(self.shape) // max(blocks.shape[0], 1)))
        for start in range(0, blocks.shape[0], ROWS_AT_ONCE):  # gguf's temporaries: a slice at a time
            part = gguf.quants.dequantize(blocks[start : start + ROWS_AT_ONCE], qtype)
            values[start : start + ROWS_AT_ONCE] = torch.from_numpy(np.ascontiguousarray(part, np.float32))
        return values.reshape(self.shape)

    def deferred(self) -> Deferred:
        """The float32 weight, dequantized when it is materialized."""
        return Deferred(self.shape, torch.float32, self.dequantize)
