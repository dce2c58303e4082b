"""A CUDA graph's stand-in for tests on the CPU: `rerun_capture` makes a `Captured` whose replay runs the
captured step again into the captured logits (DecodeGraphs(rerun_capture))."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.backends.tvm.cuda_graphs import Captured
from kiln.backends.tvm.executable import host_aligned


class Rerun:
    """Replay runs the captured step again into the captured output."""

    def __init__(
        self, executable: Any, tensors: list[torch.Tensor], kv_cache: torch.Tensor, logits: torch.Tensor
    ):
        self.executable, self.tensors, self.kv_cache, self.logits = executable, tensors, kv_cache, logits

    def replay(self) -> None:
        self.logits.copy_(torch.from_dlpack(self.executable.call(self.tensors, self.kv_cache)))


def rerun_capture(executable: Any, host: list[np.ndarray], kv_cache: torch.Tensor) -> Captured:
    tensors = [torch.from_numpy(host_aligned(a.copy())) for a in host]  # a GPU's staging aligns them
    logits = torch.from_dlpack(executable.call(tensors, kv_cache)).clone()
    return Captured(Rerun(executable, tensors, kv_cache, logits), tensors, logits, kv_cache)
