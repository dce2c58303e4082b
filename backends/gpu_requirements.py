"""What this machine lacks to run a GPU path, named piece by piece: GPU tests skip on exactly that,
and a GPU box missing one library says which instead of failing inside it."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

from kiln.backends.targets import host_gpu_arch

TORCH_CUDA = "torch_cuda"  # torch built with CUDA, seeing a device (the KV cache and graphs live there)
TVM_CUDA = "tvm_cuda"  # TVM's CUDA runtime plugin, loadable (libcudart, the driver's libcuda)
ORT_CUDA = "onnxruntime_cuda"  # onnxruntime with the CUDA execution provider
TENSORRT = "tensorrt"


def _torch_cuda() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, no device"
    return f"torch {torch.__version__} has no CUDA ({build}; install a CUDA build of torch)"


def _tvm_cuda() -> str | None:
    # loaded in a child: a failed or half-loaded CUDA plugin must not stay in this process
    probe = (
        "import ctypes; from kiln.backends.tvm.executable import tvm_library_dir; "
        "ctypes.CDLL(str(tvm_library_dir() / 'libtvm_runtime_cuda.so'), ctypes.RTLD_GLOBAL)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return None
    reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"TVM's CUDA runtime does not load ({reason}; it needs libcudart.so.13 and libcuda.so.1)"


def _onnxruntime_cuda() -> str | None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return None
    return f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu)"


def _tensorrt() -> str | None:
    if importlib.util.find_spec("tensorrt") is not None:
        return None
    return "tensorrt is not installed (pip install tensorrt)"


CHECKS = {TORCH_CUDA: _torch_cuda, TVM_CUDA: _tvm_cuda, ORT_CUDA: _onnxruntime_cuda, TENSORRT: _tensorrt}


@functools.cache
def _missing(piece: str) -> str | None:
    return CHECKS[piece]()


def missing_for_gpu(*pieces: str, archs: tuple[str, ...] = ()) -> str | None:
    """Why a GPU path cannot run here, naming every missing piece; None when nothing is missing.
    Without a GPU only that is reported: the libraries are not probed."""
    arch = host_gpu_arch()
    if arch is None:
        return "no NVIDIA GPU (nvidia-smi is absent or lists none)"
    reasons = [f"needs a GPU of {' or '.join(archs)} (here: {arch})"] if archs and arch not in archs else []
    reasons += [reason for piece in pieces if (reason := _missing(piece)) is not None]
    return "; ".join(reasons) or None
