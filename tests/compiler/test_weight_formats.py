"""`kiln inspect MODEL --weights` (compiler/weight_formats.py): each model-file tensor's stored format (a
pre-quantized checkpoint's scheme, a GGUF's block type, a float dtype) and each artifact tensor's layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.compiler.build import build_program
from kiln.compiler.options import PipelineOptions
from kiln.compiler.weight_formats import artifact_rows, checkpoint_rows
from tests.backends.conftest import save_tiny_hf
from tests.frontend.checkpoints import save_compressed, save_gptq


def _by_name(rows: list[tuple[str, str, str]]) -> dict[str, str]:
    return {name: held for name, _, held in rows}


def test_a_pre_quantized_checkpoint_names_its_scheme_per_tensor(tmp_path: Path) -> None:
    folder = tmp_path / "w4a16"
    save_compressed("llama", "w4a16", folder)
    stored = _by_name(checkpoint_rows(build_program(str(folder))))
    assert stored["model.layers.0.self_attn.q_proj.weight"] == "compressed-tensors: int4, group 32 scales"
    assert stored["lm_head.weight"] == "f32"  # left out of the scheme


def test_a_gptq_checkpoint_kept_as_blocks_names_both(tmp_path: Path) -> None:
    folder = tmp_path / "gptq"
    save_gptq("llama", folder)
    built = build_program(str(folder), PipelineOptions(quantization="gguf"))  # what auto resolves to
    stored = _by_name(checkpoint_rows(built))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert stored[q] == "gptq: GPTQ int4, group 32 scales, kept as GGUF Q4_0 blocks"
    down = _by_name(artifact_rows(built))["model.layers.0.mlp.down_proj.weight.qweight"]
    assert down.startswith("u8, Q4_0")


def test_a_llama_cpp_mix_shows_each_weights_block_type(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    save_tiny_hf("llama", folder, {"hidden_size": 256, "intermediate_size": 512})
    built = build_program(str(folder), PipelineOptions(quantization="q4_k_m"))
    held = _by_name(artifact_rows(built))
    head = held["lm_head.weight.qweight"]
    assert head == "i8, Q6_K blocks as 8-bit (6-bit values), groups of 16, symmetric"
    down = held["model.layers.0.mlp.down_proj.weight.qweight"]
    assert down == "u8, Q4_K blocks as 4-bit pairs, groups of 32, min"
    assert held["model.norm.weight"] == "f32"
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "inspect", str(folder), "--quantization", "q4_k_m", "--weights"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "model file tensors (" in result.stdout and "Q6_K blocks" in result.stdout


@pytest.mark.parametrize("name", ["model.embed_tokens.weight"])
def test_a_float_checkpoint_names_its_dtype(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "llama"
    save_tiny_hf("llama", folder)
    assert _by_name(checkpoint_rows(build_program(str(folder))))[name] == "f32"
