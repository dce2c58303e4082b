"""A GPU step's inputs in one host-to-device copy, from pinned host memory.

The step's eight small input tensors (token ids, positions, slots, block tables, ...) are packed at
64-byte aligned offsets into one page-locked host buffer, copied to one device buffer with a single
asynchronous copy, and handed to the kernels as views of it. Page-locked memory is what lets the copy
run asynchronously (from pageable memory CUDA stages it through a bounce buffer and blocks); one copy
instead of eight saves seven launches a step. Both buffers are reused and grow to the next power of
two; before the host buffer is refilled, the previous copy out of it is waited for.

On a host without CUDA the same packing runs with plain host memory (pin=False), so the offsets,
dtypes and shapes are tested on any machine; page-locking itself needs a CUDA build of torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kiln.backends.tvm.abi import ALIGNMENT


def _padded(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


class InputStaging:
    def __init__(self, device: str, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = (self.device.type == "cuda") if pin is None else pin
        self.host = torch.empty(0, dtype=torch.uint8)
        self.on_device = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._copied: torch.cuda.Event | None = None  # the last copy out of `host`

    def upload(self, arrays: list[npt.NDArray[Any]]) -> list[torch.Tensor]:
        """Device views holding `arrays`' values, valid until the next upload."""
        tensors = [torch.from_numpy(np.ascontiguousarray(array)) for array in arrays]
        offsets = []
        total = 0
        for tensor in tensors:
            offsets.append(total)
            total += _padded(tensor.numel() * tensor.element_size())
        if self._copied is not None:  # the last copy still reads the host buffer
            self._copied.synchronize()
        self._reserve(total)
        for offset, tensor in zip(offsets, tensors, strict=True):
            size = tensor.numel() * tensor.element_size()
            if size:
                self.host[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        self.on_device[:total].copy_(self.host[:total], non_blocking=self.pin)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [
            self.on_device[offset : offset + tensor.numel() * tensor.element_size()]
            .view(tensor.dtype)
            .view(tensor.shape)
            for offset, tensor in zip(offsets, tensors, strict=True)
        ]

    def _reserve(self, size: int) -> None:
        if size <= self.host.numel():
            return
        capacity = 1 << max(12, (size - 1).bit_length())
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)
        self.on_device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
