"""A SmolLM2 float32 artifact compiled once for the onnxruntime backend (through the CLI)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def onnx_smollm2_ort_artifact(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kiln.cli import main

    folder = tmp_path_factory.mktemp("onnx-ort") / "smollm2"
    assert (
        main(["compile", str(smollm2_gguf_path), "--backend", "onnxruntime", "-o", str(folder), "--quiet"])
        == 0
    )
    return folder


@pytest.fixture(scope="session")
def onnx_smollm2_ort(onnx_smollm2_ort_artifact: Path):
    """The artifact loaded: `.executable` (OnnxRuntimeExecutable), `.tokenizer`, `.model_id`."""
    from kiln.runtime.artifact import load_artifact

    return load_artifact(onnx_smollm2_ort_artifact)
