"""SmolLM2 float32 (O2) on ONNX Runtime: a ragged batch against the reference backend, and the CLI
end to end (compile, verify, generate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.backends.gpu_requirements import ORT_CUDA, missing_for_gpu
from kiln.backends.targets import host_gpu_arch
from kiln.cli import main
from kiln.ir.step import SequenceSlice, build_step_inputs

TOLERANCE = 1e-4  # max |ours - reference| / max |reference|


def test_ragged_batch_matches_the_reference(onnx_smollm2_ort, smollm2_o2) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in (40, 23, 9)]
    tables = [[5, 2, 9], [1, 7], [3]]
    first = build_step_inputs([SequenceSlice(prompts[0][:30], 0, tables[0])], 16)
    second = build_step_inputs(
        [
            SequenceSlice(prompts[0][30:], 30, tables[0]),  # chunked prefill, second chunk
            SequenceSlice(prompts[1], 0, tables[1]),  # a fresh prefill
            SequenceSlice(prompts[2], 0, tables[2], logits_at=range(9)),  # a logits row per token
        ],
        16,
    )
    results = []
    for executable in (onnx_smollm2_ort.executable, smollm2_o2.executable):
        cache = executable.kv_cache_spec.allocate(12, 16)
        executable.step(first, cache)
        results.append(torch.from_numpy(executable.step(second, cache)))
    ours, reference = results
    assert ours.shape == reference.shape == (11, 49152)
    assert float((ours - reference).abs().max() / reference.abs().max()) < TOLERANCE


def test_cli_verify_and_generate(onnx_smollm2_ort_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(onnx_smollm2_ort_artifact)]) == 0
    assert "probe logits within" in capsys.readouterr().out
    prompt = "The capital of France is"
    assert main(["generate", str(onnx_smollm2_ort_artifact), "--prompt", prompt, "--max-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_refuses_a_cpu_mcpu_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "compile",
            "smollm2-135m-instruct",
            "--backend",
            "onnxruntime",
            "--target",
            "cpu:znver4",
            "-o",
            str(tmp_path / "out"),
        ]
    )
    assert code != 0
    assert "cpu:znver4" in capsys.readouterr().err


ORT_CUDA_MISSING = missing_for_gpu(ORT_CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(ORT_CUDA_MISSING is not None, reason=ORT_CUDA_MISSING or "")
def test_cuda_execution_provider_runs_the_artifact(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    target = f"cuda:{host_gpu_arch()}"
    out = tmp_path / "cuda"
    args = ["compile", str(smollm2_gguf_path), "--backend", "onnxruntime", "--target", target, "-o", str(out)]
    assert main(args) == 0
    assert main(["verify", str(out)]) == 0
