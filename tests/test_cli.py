"""The `kiln` command as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest


def kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kiln: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def _gpt2_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file(tmp_path: Path) -> None:
    _assert_one_line_error(kiln("generate", str(tmp_path / "nope.gguf"), "--prompt", "hi"), "nope.gguf")


def test_unknown_model_name() -> None:
    _assert_one_line_error(
        kiln("generate", "no-such-model", "--prompt", "hi"), "no-such-model", "smollm2-135m-instruct"
    )


def test_truncated_gguf(tmp_path: Path, smollm2_gguf_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf_path.read_bytes()[: 40 * 1024 * 1024])
    _assert_one_line_error(kiln("generate", str(truncated), "--prompt", "hi"), "truncated.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    result = kiln("inspect", str(_gpt2_gguf(tmp_path / "gpt2.gguf")))
    _assert_one_line_error(result, "gpt2", "LlamaForCausalLM")


def test_usage_error_exits_2() -> None:
    result = kiln("generate")
    assert result.returncode == 2
    assert "usage:" in result.stderr


@pytest.mark.slow
def test_generate_prints_a_chat_reply(smollm2_gguf_path: Path) -> None:
    result = kiln(
        "generate",
        str(smollm2_gguf_path),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "8",
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_inspect_prints_the_ir(smollm2_gguf_path: Path) -> None:
    result = kiln("inspect", str(smollm2_gguf_path), "--ir")
    assert result.returncode == 0, result.stderr
    assert "LlamaForCausalLM" in result.stdout
    assert result.stdout.count("] = paged_attention(") == 30
    assert "GGUF weights by type: Q4_1 63.3 MiB, Q8_0 28.7 MiB, F32 0.1 MiB" in result.stdout


def test_generate_refuses_an_image_for_a_text_model(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    args = [
        "generate",
        str(smollm2_gguf_path),
        "--chat",
        "--prompt",
        "Hi",
        "--image",
        str(tmp_path / "cat.png"),
    ]
    refused = kiln(*args)  # (after the compile's progress, where the compile cache has not the model)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last == "kiln: error: messages[0].content[0] is an image, and this model takes text only", last
    _assert_one_line_error(kiln(*args[:-1], str(tmp_path / "missing.png")), "--image", "missing.png")
