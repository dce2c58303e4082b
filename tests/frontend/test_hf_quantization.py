"""Pre-quantized HF checkpoints (frontend/hf_quantization.py), made by compressed-tensors from tiny random
models: Kiln's logits are the float model's holding the library's own dequantized values, and where
transformers loads the format, its greedy tokens are transformers'. The formats Kiln does not load are
refused by name before a weight is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kiln.backends.base import allocate_kv_cache
from kiln.backends.reference import ReferenceExecutable
from kiln.errors import ModelLoadError
from kiln.frontend.capture import capture_weights
from kiln.frontend.hf_loader import load_hf_dir
from kiln.ir.deferred import Deferred, materialize
from kiln.ir.step import SequenceSlice, build_step_inputs
from tests.frontend.checkpoints import (
    SCHEMES,
    quantization_config,
    save_compressed,
    transformers_checkpoint,
    transformers_logits,
)

PROMPT = [3, 17, 9, 120, 45, 2, 77, 200, 31, 8]
# formats transformers 5 with compressed-tensors 0.20 loads and runs on a CPU (not its asymmetric pack,
# static FP8, or FP8 blocks on a model narrower than the activation groups): compared with its own run
TRANSFORMERS_RUNS = ("fp8_dynamic", "w4a16", "w8a16", "w4a16_channel", "w8a8_int")


def kiln_logits(folder: Path) -> np.ndarray:
    """Every prompt position's logits of the checkpoint as Kiln loads it, on the reference backend."""
    source = load_hf_dir(folder)
    captured = capture_weights(source.config, source.float_weights())
    executable = ReferenceExecutable(captured.graph, captured.weights)
    cache = allocate_kv_cache(executable, 2, 16)
    step = build_step_inputs([SequenceSlice(PROMPT, 0, [1], logits_at=range(len(PROMPT)))], 16)
    return executable.step(step, cache)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(scheme: str) -> tuple[Path, torch.nn.Module]:
        if scheme not in made:
            folder = tmp_path_factory.mktemp("quantized") / scheme
            made[scheme] = folder, save_compressed("llama", scheme, folder)
        return made[scheme]

    return make


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_logits_are_the_dequantized_models(scheme: str, checkpoints: Any) -> None:
    """The FP8 cases fail on a loader that casts the float8 weights and drops their scales (the old one:
    it served FP8_DYNAMIC's first token wrong)."""
    folder, dequantized = checkpoints(scheme)
    expected = transformers_logits(dequantized, PROMPT).numpy()
    logits = kiln_logits(folder)
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("scheme", TRANSFORMERS_RUNS)
def test_greedy_tokens_are_transformers_on_the_same_files(scheme: str, checkpoints: Any) -> None:
    """Weights as transformers with compressed-tensors decompresses them (activations in float: Kiln does
    not quantize an A8 scheme's activations)."""
    folder, _ = checkpoints(scheme)
    expected = transformers_logits(transformers_checkpoint(folder), PROMPT).numpy()
    logits = kiln_logits(folder)
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_weights_stay_deferred_and_name_their_format(checkpoints: Any) -> None:
    folder, _ = checkpoints("w4a16")
    weights = load_hf_dir(folder).weights
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Deferred) and q.dtype == torch.float32 and tuple(q.shape) == (64, 64)
    assert not any(name.endswith(("weight_packed", "weight_scale", "weight_shape")) for name in weights)
    assert materialize(weights["lm_head.weight"]).dtype == torch.float32  # ignored: stored as it was


def _with_config(folder: Path, tmp_path: Path, change: Any) -> Path:
    copy = tmp_path / "changed"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    change(config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


REFUSED: list[tuple[dict[str, Any], str]] = [
    (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        r"quantization 'bitsandbytes' \(4-bit nf4\) is not supported",
    ),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        r"quantization 'gptq' \(4-bit\) is not supported",
    ),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, r"quantization 'awq' \(4-bit\)"),
    ({"quant_method": "hqq", "nbits": 4}, "quantization 'hqq'"),
    ({"quant_method": "mxfp4"}, "quantization 'mxfp4'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"quantization 'fp8' \(e5m2\)"),
]


@pytest.mark.parametrize(("config", "message"), REFUSED)
def test_other_methods_are_refused_by_name_before_a_weight_is_read(
    config: dict[str, Any], message: str, checkpoints: Any, tmp_path: Path
) -> None:
    folder, _ = checkpoints("fp8_dynamic")
    changed = _with_config(folder, tmp_path, lambda c: c.__setitem__("quantization_config", config))
    for shard in changed.glob("*.safetensors"):
        shard.write_bytes(b"not read")  # a refusal that read a weight would fail on these instead
    with pytest.raises(ModelLoadError, match=message) as error:
        load_hf_dir(changed)
    assert "bf16" in (error.value.hint or "") and "GGUF" in (error.value.hint or "")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q: q.__setitem__("sparsity_config", {"format": "sparse-24"}), "with sparsity"),
        (lambda q: q.__setitem__("kv_cache_scheme", {"num_bits": 8}), "with a KV-cache scheme"),
        (lambda q: q.__setitem__("transform_config", {"config_groups": {"u": {}}}), "transforms"),
        (lambda q: q.__setitem__("format", "nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
        (
            lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 4),
            "float-quantized .*: float 4-bit weights",
        ),
        (
            lambda q: q["config_groups"]["group_0"].__setitem__("output_activations", {"num_bits": 8}),
            "output activations",
        ),
    ],
)
def test_compressed_tensors_variants_kiln_does_not_load_are_refused(
    change: Any, message: str, checkpoints: Any, tmp_path: Path
) -> None:
    folder, _ = checkpoints("fp8_dynamic")
    config = quantization_config(folder)
    config["config_groups"]["group_0"]["format"] = None

    def changed(whole: dict[str, Any]) -> None:
        change(config)
        whole["quantization_config"] = config

    with pytest.raises(ModelLoadError, match=message):
        load_hf_dir(_with_config(folder, tmp_path, changed))


def test_an_older_gptq_side_config_is_refused(checkpoints: Any, tmp_path: Path) -> None:
    folder, _ = checkpoints("w4a16")
    changed = _with_config(folder, tmp_path, lambda c: c.pop("quantization_config"))
    (changed / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ModelLoadError, match=r"quantize_config\.json: quantization 'gptq'"):
        load_hf_dir(changed)


def test_fine_grained_fp8_blocks_cut_at_the_edges(tmp_path: Path) -> None:
    """`quant_method: fp8` (Qwen3-FP8, DeepSeek-V3's layout) written as transformers' FP8 integration
    reads it: float8 weights, one `weight_scale_inv` a 48 × 48 block (the last ones cut), multiplied."""
    from tests.backends.conftest import save_tiny_hf

    model = save_tiny_hf("llama", tmp_path / "float")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "float" / "model.safetensors")
    block = 48
    expected = {}
    for name in list(tensors):
        if not name.endswith("proj.weight"):
            continue
        weight = tensors[name]
        rows, columns = weight.shape
        padded = torch.zeros(-(-rows // block) * block, -(-columns // block) * block)
        padded[:rows, :columns] = weight
        blocks = padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)
        scale = blocks.abs().amax((1, 3)) / 448.0
        spread = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :columns]
        stored = (weight / spread).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = stored, scale
        expected[name] = stored.float() * spread
    folder = tmp_path / "fp8"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for file in (tmp_path / "float").iterdir():
        if (file.suffix == ".json" and file.name != "config.json") or file.name.startswith("tokenizer"):
            (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": ["lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_hf_dir(folder).weights
    for name, values in expected.items():
        assert torch.equal(materialize(weights[name]), values), name
    with torch.no_grad():
        for name, values in expected.items():
            model.get_submodule(name.removesuffix(".weight")).weight.copy_(values)
    reference = transformers_logits(model, PROMPT).numpy()
    logits = kiln_logits(folder)
    assert np.abs(logits - reference).max() / np.abs(reference).max() < 1e-5


def test_quantized_tensors_without_a_quantization_config_are_refused(
    checkpoints: Any, tmp_path: Path
) -> None:
    folder, _ = checkpoints("fp8_dynamic")
    changed = _with_config(folder, tmp_path, lambda c: c.pop("quantization_config"))
    with pytest.raises(ModelLoadError, match=r"no quantization_config, but .* is stored quantized"):
        load_hf_dir(changed)
