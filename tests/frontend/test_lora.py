"""Reading LoRA adapters: PEFT folders with PEFT's scaling (lora_alpha / r, rsLoRA, alpha_pattern) and
llama.cpp's GGUFs of the same adapters (its q/k row permutation undone) into the same updates; every
kind of file Kiln cannot serve refused naming why."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from kiln.frontend.lora import AdapterError, read_adapter
from kiln.ir.adapters import AdapterBase
from tests.conftest import TinyLoRAModel

LLAMA = AdapterBase("LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2)


def _peft_b(folder: Path, layer: int, module: str) -> np.ndarray:
    tensors = load_file(folder / "adapter_model.safetensors")
    return next(v for k, v in tensors.items() if f"layers.{layer}." in k and f"{module}.lora_B" in k)


def test_peft_scaling_alpha_over_rank_rslora_and_alpha_pattern(
    tiny_lora_models: dict[str, TinyLoRAModel], tmp_path: Path
) -> None:
    llama = tiny_lora_models["llama"]
    r4 = read_adapter(llama.adapters["r4"], LLAMA)
    assert r4.rank == 4 and len(r4.updates) == 7 * 2
    np.testing.assert_allclose(
        r4.updates[("q_proj", 1)][1], _peft_b(llama.adapters["r4"], 1, "q_proj") * 8 / 4, rtol=1e-6
    )
    rs8 = read_adapter(llama.adapters["rs8"], LLAMA)
    assert {module for module, _ in rs8.updates} == {"q_proj", "v_proj", "o_proj"}
    np.testing.assert_allclose(
        rs8.updates[("v_proj", 0)][1],
        _peft_b(llama.adapters["rs8"], 0, "v_proj") * 16 / math.sqrt(8),
        rtol=1e-6,
    )
    patterned = tmp_path / "patterned"
    shutil.copytree(llama.adapters["r4"], patterned)
    config = json.loads((patterned / "adapter_config.json").read_text())
    (patterned / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"q_proj": 2}}))
    scaled = read_adapter(patterned, LLAMA)
    np.testing.assert_allclose(scaled.updates[("q_proj", 0)][1], r4.updates[("q_proj", 0)][1] / 4, rtol=1e-6)
    np.testing.assert_array_equal(scaled.updates[("k_proj", 0)][1], r4.updates[("k_proj", 0)][1])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_cpp_gguf_adapters_read_as_their_peft_folders(
    kind: str, tiny_lora_models: dict[str, TinyLoRAModel]
) -> None:
    model = tiny_lora_models[kind]
    base = AdapterBase("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM", 4, 2)
    for name in ("r4", "r8"):
        peft, from_gguf = (
            read_adapter(model.adapters[name], base),
            read_adapter(model.gguf_adapters[name], base),
        )
        assert set(peft.updates) == set(from_gguf.updates)
        for key, (a, b) in peft.updates.items():
            np.testing.assert_allclose(from_gguf.updates[key][0], a, atol=1e-7)
            np.testing.assert_allclose(from_gguf.updates[key][1], b, atol=1e-6)


def _edited_config(source: Path, folder: Path, **fields: object) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return folder


def test_what_cannot_be_served_is_refused_naming_why(
    tiny_lora_models: dict[str, TinyLoRAModel], tmp_path: Path
) -> None:
    llama = tiny_lora_models["llama"]
    r4 = llama.adapters["r4"]
    cases = {
        "no such adapter folder or file": tmp_path / "nowhere",
        "use_dora DoRA adapters are not supported": _edited_config(r4, tmp_path / "dora", use_dora=True),
        "modules_to_save full copies": _edited_config(r4, tmp_path / "save", modules_to_save=["lm_head"]),
        "peft_type is IA3, not LORA": _edited_config(r4, tmp_path / "ia3", peft_type="IA3"),
    }
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(r4 / "adapter_config.json", no_weights)
    cases["no adapter_model.safetensors"] = no_weights
    not_adapter = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(not_adapter, "llama")
    writer.add_type("model")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cases["general.type 'model', not a LoRA adapter"] = not_adapter
    for said, path in cases.items():
        with pytest.raises(AdapterError, match=said.replace("(", r"\(")):
            read_adapter(path, LLAMA)
    with pytest.raises(
        AdapterError, match="a LoRA for architecture llama, and this model is Qwen2ForCausalLM"
    ):
        read_adapter(llama.gguf_adapters["r4"], AdapterBase("Qwen2ForCausalLM", 4, 2))
