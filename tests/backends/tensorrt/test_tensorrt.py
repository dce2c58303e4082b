"""TensorRT without a GPU: compile writes and checks the ONNX model, then stops with exit 2."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import onnx
import pytest

from kiln.backends.gpu_requirements import TENSORRT, missing_for_gpu
from kiln.backends.onnx import MODEL_FILE, check_model
from kiln.backends.targets import Target, host_gpu_arch
from kiln.backends.tensorrt.backend import TensorRTBackend
from kiln.cli import main


def test_refuses_cpu_targets_and_names_its_version() -> None:
    backend = TensorRTBackend()
    refusal = backend.capabilities(Target("cpu")).unavailable
    reason = refusal.reason if refusal is not None else None
    assert reason is not None and "NVIDIA GPU" in reason
    assert backend.capabilities(Target("cuda", "sm_90")).unavailable is None
    try:
        installed = importlib.metadata.version("tensorrt")
    except importlib.metadata.PackageNotFoundError:
        installed = "unavailable"
    assert backend.version() == f"tensorrt-{installed}"  # the one a manifest records


@pytest.mark.skipif(host_gpu_arch() is not None, reason="this machine has a GPU: the engine would be built")
def test_compile_without_a_gpu_keeps_the_checked_onnx_and_exits_2(
    smollm2_gguf_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "trt"
    code = main(
        ["compile", str(smollm2_gguf_path), "--backend", "tensorrt", "--target", "cuda:sm_90", "-o", str(out)]
    )
    assert code == 2
    error = capsys.readouterr().err
    assert "no NVIDIA GPU" in error and "cuda-sm_90/model.onnx" in error
    model = onnx.load_model(str(out / "cuda-sm_90" / MODEL_FILE))
    assert "check_model(full_check=True) passes" in check_model(model)[0]
    assert {o.domain for o in model.opset_import} == {""}  # standard ops only: TensorRT parses them
    assert not (out / "manifest.json").exists()  # not a runnable artifact


TENSORRT_MISSING = missing_for_gpu(TENSORRT)


@pytest.mark.gpu
@pytest.mark.skipif(TENSORRT_MISSING is not None, reason=TENSORRT_MISSING or "")
def test_engine_builds_on_a_gpu(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    arch = host_gpu_arch()
    out = tmp_path / "trt"
    assert (
        main(
            [
                "compile",
                str(smollm2_gguf_path),
                "--backend",
                "tensorrt",
                "--target",
                f"cuda:{arch}",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert main(["verify", str(out)]) == 0
