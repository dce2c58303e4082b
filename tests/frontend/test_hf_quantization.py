"""Pre-quantized HF checkpoints (frontend/hf_quantization.py), made from tiny random models by
compressed-tensors, auto-gptq (GPTQ) and AutoAWQ: Kiln's logits are the float model's holding the tool's
own dequantized values, and where transformers loads the format on a CPU, its greedy tokens are
transformers'. The formats Kiln does not load are
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
from kiln.compiler import ModelOptions, compile_model, resolve
from kiln.errors import ModelLoadError
from kiln.frontend.capture import capture_weights
from kiln.frontend.hf_loader import load_hf_dir
from kiln.ir.deferred import Deferred, materialize
from kiln.ir.gguf_blocks import QuantizedTensor
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.artifact import load_artifact
from tests.frontend.checkpoints import (
    SCHEMES,
    quantization_config,
    save_awq,
    save_compressed,
    save_gptq,
    transformers_checkpoint,
    transformers_logits,
)

PROMPT = [3, 17, 9, 120, 45, 2, 77, 200, 31, 8]
# formats transformers 5 with compressed-tensors 0.20 loads and runs on a CPU (not its asymmetric pack,
# static FP8, or FP8 blocks on a model narrower than the activation groups): compared with its own run
TRANSFORMERS_RUNS = ("fp8_dynamic", "w4a16", "w8a16", "w4a16_channel", "w8a8_int")
# GPTQ and AWQ checkpoints as auto-gptq and AutoAWQ write them (transformers runs neither on a CPU without
# gptqmodel: the reference is the tool's own dequantizer), on Llama and Qwen2 (biased q/k/v) shapes
PACKED: dict[str, Any] = {
    "gptq_llama": lambda folder: save_gptq("llama", folder),
    "gptq_qwen2_act_order_asym": lambda folder: save_gptq("qwen2", folder, desc_act=True, sym=False),
    "gptq_llama_8bit_channel": lambda folder: save_gptq("llama", folder, bits=8, group_size=-1),
    "gptq_v2_qwen2": lambda folder: save_gptq("qwen2", folder, checkpoint_format="gptq_v2"),
    "awq_llama": lambda folder: save_awq("llama", folder),
    "awq_qwen2": lambda folder: save_awq("qwen2", folder),
}


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
            saved = PACKED[scheme](folder) if scheme in PACKED else save_compressed("llama", scheme, folder)
            made[scheme] = folder, saved
        return made[scheme]

    return make


@pytest.mark.parametrize("scheme", [*SCHEMES, *PACKED])
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
        {"quant_method": "gptq", "bits": 3, "group_size": 128},
        r"quantization 'gptq' \(3-bit\) is not supported",
    ),
    (
        {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        r"quantization 'gptq' in the 'marlin' format is not supported",
    ),
    (
        {"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*mlp.*": {}}},
        r"quantization 'gptq' with per-module overrides \(dynamic\)",
    ),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization 'awq' \(gemv\) is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "exllama"}, r"quantization 'awq' \(exllama\)"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "quantization 'awq' without zero points"),
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


@pytest.mark.parametrize(
    ("scheme", "backend", "kept", "tolerance"),
    [
        ("gptq_llama", "tvm", "Q4_0", 1e-3),  # the integer-dot kernels on the kept blocks
        ("gptq_llama_8bit_channel", "onnxruntime", "Q8_0", 1e-4),
        ("gptq_qwen2_act_order_asym", "onnxruntime", None, 1e-4),  # float: no block holds it
        ("awq_llama", "onnxruntime", None, 1e-4),
    ],
)
def test_compiled_artifacts_give_the_dequantized_models_logits(
    scheme: str, backend: str, kept: str | None, tolerance: float, checkpoints: Any, tmp_path: Path
) -> None:
    """`kiln compile` of a GPTQ / AWQ folder with the defaults (a float32 KV cache) on TVM for this CPU
    and ONNX Runtime: symmetric GPTQ keeps its groups as GGUF blocks (`--quantization auto` resolves to
    gguf), the others compile as their float values; the reference's logits within `tolerance` of the
    largest, greedy tokens equal."""
    folder, dequantized = checkpoints(scheme)
    plan = resolve(ModelOptions.create(str(folder), backend=backend, kv_cache_dtype="f32"))
    assert plan.quantization == ("gguf" if kept else None)
    compile_model(plan, tmp_path / "artifact")
    manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
    held = set(manifest["model"].get("gguf_types", {}).values())
    assert held == ({kept} if kept else set())
    executable = load_artifact(tmp_path / "artifact").executable
    cache = allocate_kv_cache(executable, 2, 16)
    step = build_step_inputs([SequenceSlice(PROMPT, 0, [1], logits_at=range(len(PROMPT)))], 16)
    logits = executable.step(step, cache)
    expected = transformers_logits(dequantized, PROMPT).numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() < tolerance
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize(
    ("scheme", "kind"),
    [("gptq_llama", "Q4_0"), ("gptq_v2_qwen2", "Q4_0"), ("gptq_llama_8bit_channel", "Q8_0")],
)
def test_symmetric_groups_are_kept_as_blocks_holding_the_same_values(
    scheme: str, kind: str, checkpoints: Any
) -> None:
    """Symmetric 4- and 8-bit integers in groups of whole 32-input blocks under float16 scales are
    llama.cpp's Q4_0 / Q8_0 blocks exactly: their values are the tool's dequantized weights, bit for bit."""
    folder, dequantized = checkpoints(scheme)
    weights = load_hf_dir(folder).weights
    for name, module in dequantized.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            blocks = weights[f"{name}.weight"]
            assert isinstance(blocks, QuantizedTensor) and blocks.ggml_type == kind, name
            assert torch.equal(blocks.dequantize(), module.weight.detach()), name
    assert blocks.origin is not None and blocks.origin.startswith("gptq: GPTQ")


def test_stacked_experts_of_blocks_stay_blocks() -> None:
    """A pre-quantized MoE checkpoint's per-expert blocks stack as one [E, N, K] tensor of blocks, as a
    GGUF's experts are; experts of mixed kinds stack as float values."""
    from types import SimpleNamespace

    from kiln.frontend.models.moe import stack_experts

    rows = [np.full((2, 18), i, dtype=np.uint8) for i in range(3)]
    experts = {
        f"model.layers.0.mlp.experts.{i}.gate_proj.weight": QuantizedTensor(
            "Q4_0", (2, 32), rows[i], origin="x"
        )
        for i in range(3)
    }
    config: Any = SimpleNamespace(num_experts=3)  # all stack_experts reads of the config
    stacked = stack_experts(config, experts)["model.layers.0.mlp.experts.gate_proj.weight"]
    assert isinstance(stacked, QuantizedTensor) and stacked.shape == (3, 2, 32) and stacked.origin == "x"
    assert np.array_equal(stacked.read(), np.concatenate(rows))
    experts["model.layers.0.mlp.experts.2.gate_proj.weight"] = torch.zeros(2, 32)
    mixed = stack_experts(config, experts)["model.layers.0.mlp.experts.gate_proj.weight"]
    assert isinstance(mixed, Deferred) and tuple(mixed.shape) == (3, 2, 32)


def test_gptq_and_awq_weights_stay_deferred_and_name_their_format(checkpoints: Any) -> None:
    folder, _ = checkpoints("gptq_qwen2_act_order_asym")
    weights = load_hf_dir(folder).weights
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Deferred) and tuple(q.shape) == (64, 64)
    assert q.origin == "gptq: GPTQ int4, group 32 scales, zero points"
    assert weights["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float16  # stored as it was
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx")) for name in weights)
    folder, _ = checkpoints("awq_llama")
    origin = load_hf_dir(folder).weights["model.layers.1.mlp.down_proj.weight"].origin
    assert origin == "awq: AWQ gemm int4, group 32 scales, zero points"


@pytest.mark.parametrize(
    ("scheme", "side_file", "side_config"),
    [
        ("gptq_llama", "quantize_config.json", {"bits": 4, "group_size": 32, "desc_act": False, "sym": True}),
        (
            "awq_llama",
            "quant_config.json",
            {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"},
        ),
    ],
)
def test_an_older_folders_side_config_loads(
    scheme: str, side_file: str, side_config: dict[str, Any], checkpoints: Any, tmp_path: Path
) -> None:
    """Older auto-gptq and AutoAWQ folders hold the quantization beside config.json, not in it."""
    folder, dequantized = checkpoints(scheme)
    changed = _with_config(folder, tmp_path, lambda c: c.pop("quantization_config"))
    (changed / side_file).write_text(json.dumps(side_config))
    expected = transformers_logits(dequantized, PROMPT).numpy()
    assert np.abs(kiln_logits(changed) - expected).max() / np.abs(expected).max() < 1e-5
    (changed / side_file).write_text(json.dumps({**side_config, "bits": 3, "w_bit": 3}))
    with pytest.raises(ModelLoadError, match=rf"{side_file}: quantization '\w+' \(3-bit\) is not supported"):
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


@pytest.mark.parametrize("scheme", ["fp8_dynamic", "gptq_llama"])
def test_quantized_tensors_without_a_quantization_config_are_refused(
    scheme: str, checkpoints: Any, tmp_path: Path
) -> None:
    folder, _ = checkpoints(scheme)
    changed = _with_config(folder, tmp_path, lambda c: c.pop("quantization_config"))
    with pytest.raises(ModelLoadError, match=r"no quantization_config, but .* is stored quantized"):
        load_hf_dir(changed)
