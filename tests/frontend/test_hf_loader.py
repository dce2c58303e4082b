"""HF checkpoint directories: tiny random models saved by transformers, loaded back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.errors import ModelLoadError, UnsupportedArchitectureError
from kiln.frontend.hf_loader import load_hf_dir
from kiln.frontend.load import load_model
from kiln.ir.deferred import materialize

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_path: Path) -> Path:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json and tokenizer_config.json)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_model(
    folder: Path, tokenizer_files: Path, kind: str, max_shard_size: str = "100KB", **config: Any
) -> torch.nn.Module:
    """A random tiny `kind` ("llama", "qwen2") model saved with transformers, plus a tokenizer."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(0)
    model = model_class(config_class(**(TINY | config)))
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 5]).save_pretrained(folder)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, folder / file.name)
    return model


def expected_weights(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if tied:
        del state["lm_head.weight"]
    return state


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_llama(tmp_path: Path, tokenizer_files: Path, tied: bool) -> None:
    model = save_tiny_model(tmp_path, tokenizer_files, "llama", tie_word_embeddings=tied, eos_token_id=2)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()

    source = load_hf_dir(tmp_path)
    config = source.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (256, 512, 1e-5)
    assert config.tie_word_embeddings == tied
    assert config.eos_token_ids == (2, 5)  # config.json's 2, then generation_config.json's 5
    assert not config.qkv_bias

    want = expected_weights(model, tied)
    assert set(source.weights) == set(want)
    for name, tensor in want.items():
        assert torch.equal(materialize(source.weights[name]), tensor), name
    assert source.tokenizer.chat_template and source.tokenizer.eos_token == "<|im_end|>"
    assert source.name == tmp_path.name and source.path == tmp_path


def test_sharded_qwen2(tmp_path: Path, tokenizer_files: Path) -> None:
    model = save_tiny_model(tmp_path, tokenizer_files, "qwen2", tie_word_embeddings=True, eos_token_id=5)
    source = load_hf_dir(tmp_path)
    assert source.config.architecture == "Qwen2ForCausalLM"
    assert source.config.qkv_bias and not source.config.o_bias
    assert source.config.sliding_window is None
    assert source.config.eos_token_ids == (5, 2)
    want = expected_weights(model, tied=True)
    assert "model.layers.1.self_attn.q_proj.bias" in want
    assert set(source.weights) == set(want)
    assert all(torch.equal(materialize(source.weights[name]), tensor) for name, tensor in want.items())


def test_single_file_bfloat16(tmp_path: Path, tokenizer_files: Path) -> None:
    model = save_tiny_model(tmp_path, tokenizer_files, "llama", max_shard_size="1GB").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    source = load_hf_dir(tmp_path)
    want = expected_weights(model, tied=False)
    for name, tensor in want.items():
        assert source.weights[name].dtype == torch.bfloat16 and torch.equal(
            materialize(source.weights[name]), tensor
        )


def test_loose_safetensors_files(tmp_path: Path, tokenizer_files: Path) -> None:
    model = save_tiny_model(tmp_path, tokenizer_files, "llama")
    (tmp_path / "model.safetensors.index.json").unlink()
    source = load_hf_dir(tmp_path)
    assert set(source.weights) == set(model.state_dict())


def test_load_model_picks_the_hf_loader(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    assert load_model(str(tmp_path)).config.architecture == "LlamaForCausalLM"


def test_missing_config(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no config\.json") as error:
        load_hf_dir(tmp_path)
    assert error.value.hint


def test_missing_weights(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    for file in tmp_path.glob("model*.safetensors*"):
        file.unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights") as error:
        load_hf_dir(tmp_path)
    assert error.value.hint and ".safetensors" in error.value.hint


def test_missing_shard(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=rf"shards named in .* are missing: {shard.name}"):
        load_hf_dir(tmp_path)


def test_corrupt_shard(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot read safetensors"):
        load_hf_dir(tmp_path)


def test_unsupported_architecture(tmp_path: Path, tokenizer_files: Path) -> None:
    save_tiny_model(tmp_path, tokenizer_files, "llama")
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="'GPT2LMHeadModel' is not supported"):
        load_hf_dir(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_hf_dir(tmp_path / "absent")


def _sentence_transformers_folder(path: Path, modes: dict[str, bool]) -> Path:
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
    return path


@pytest.mark.parametrize(
    ("modes", "pooling"),
    [({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_mean_tokens": True}, "mean")],
)
def test_sentence_transformers_pooling_is_read(tmp_path: Path, modes: dict[str, bool], pooling: str) -> None:
    from kiln.frontend.hf_loader import sentence_transformers_pooling

    assert sentence_transformers_pooling(tmp_path) is None
    assert sentence_transformers_pooling(_sentence_transformers_folder(tmp_path, modes)) == pooling


def test_a_pooling_kiln_does_not_do_is_refused_by_name(tmp_path: Path) -> None:
    from kiln.frontend.hf_loader import sentence_transformers_pooling

    folder = _sentence_transformers_folder(tmp_path, {"pooling_mode_cls_token": True})
    with pytest.raises(ModelLoadError, match="pooling pooling_mode_cls_token is not supported"):
        sentence_transformers_pooling(folder)


def test_a_bare_decoder_without_a_head_loads_tied(tmp_path: Path, tokenizer_files: Path) -> None:
    """An embedding model saved as transformers' Qwen2Model (gte-Qwen2's way): no `model.` prefix, no
    lm_head, tie_word_embeddings false; its embedding table stands in for the head."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen2Model(transformers.Qwen2Config(**(TINY | {"tie_word_embeddings": False})))
    model.save_pretrained(tmp_path)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, tmp_path / file.name)
    source = load_hf_dir(tmp_path)
    assert source.config.architecture == "Qwen2Model" and source.config.tie_word_embeddings
    want = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    assert set(source.weights) == set(want)
    assert all(torch.equal(materialize(source.weights[name]), tensor) for name, tensor in want.items())
