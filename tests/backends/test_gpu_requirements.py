"""The named reasons GPU tests skip on: each piece's check, run for real on this machine."""

from __future__ import annotations

import importlib.util

import onnxruntime
import pytest
import torch

from kiln.backends import gpu_requirements
from kiln.backends.gpu_requirements import CHECKS, ORT_CUDA, TENSORRT, TORCH_CUDA, TVM_CUDA, missing_for_gpu
from kiln.backends.targets import host_gpu_arch


@pytest.mark.skipif(host_gpu_arch() is not None, reason="this machine has a GPU")
def test_without_a_gpu_only_that_is_named() -> None:
    assert missing_for_gpu(TORCH_CUDA, TVM_CUDA, ORT_CUDA, TENSORRT) == (
        "no NVIDIA GPU (nvidia-smi is absent or lists none)"
    )


def test_each_piece_names_what_is_missing_here() -> None:
    torch_reason = CHECKS[TORCH_CUDA]()
    assert (torch_reason is None) == torch.cuda.is_available()
    if torch_reason is not None:
        assert torch_reason.startswith(f"torch {torch.__version__} has no CUDA")
    ort_reason = CHECKS[ORT_CUDA]()
    has_ort_cuda = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert (ort_reason is None) == has_ort_cuda
    assert ort_reason is None or "install onnxruntime-gpu" in ort_reason
    trt_reason = CHECKS[TENSORRT]()
    assert (trt_reason is None) == (importlib.util.find_spec("tensorrt") is not None)
    tvm_reason = CHECKS[TVM_CUDA]()
    assert tvm_reason is None or tvm_reason.startswith("TVM's CUDA runtime does not load (")


def test_a_gpu_of_another_arch_and_missing_libraries_are_all_named(monkeypatch) -> None:
    monkeypatch.setattr(gpu_requirements, "host_gpu_arch", lambda: "sm_75")
    monkeypatch.setattr(gpu_requirements, "_missing", lambda piece: f"{piece} is missing")
    assert missing_for_gpu(TORCH_CUDA, TENSORRT, archs=("sm_87", "sm_90")) == (
        "needs a GPU of sm_87 or sm_90 (here: sm_75); torch_cuda is missing; tensorrt is missing"
    )
    monkeypatch.setattr(gpu_requirements, "_missing", lambda piece: None)
    assert missing_for_gpu(TORCH_CUDA, archs=("sm_75",)) is None
