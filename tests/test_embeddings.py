"""`kiln.LLM.embed` against transformers: a tiny random-weight Qwen3-Embedding-style model (a bare
decoder saved with sentence-transformers' last-token Pooling and Normalize modules) on the reference and
TVM backends, and pooled by the mean on request. SmolLM2's GGUF is checked through the server
(tests/server/test_embeddings.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.llm import LLM

COSINE_TOLERANCE = 1e-4
TEXTS = ["t3 t4 t5 t6", "t9 t8 t7 t6 t5 t4 t3 t2 t10 t11 t12 t13 t14 t15 t16 t17 t18 t19 t20 t21"]


@pytest.fixture(scope="module")
def tiny_embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_qwen3_embedding")
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3Model(config).save_pretrained(path)  # no lm_head, no `model.` prefix
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 64)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 32,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_lasttoken": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


def _transformers_hidden(model: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy().astype(np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("backend", ["reference", "tvm"])
def test_an_embedding_model_pools_its_last_token_like_transformers(
    tiny_embedding_dir: Path, backend: str
) -> None:
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny_embedding_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_embedding_dir)
    llm = LLM(str(tiny_embedding_dir), backend=backend, show_progress=False)
    assert llm.engine.config.pooling == "last"  # read from 1_Pooling/config.json
    vectors = llm.embed(TEXTS)
    for text, vector in zip(TEXTS, vectors, strict=True):
        ids = tokenizer(text)["input_ids"]
        reference = _transformers_hidden(model, ids)[-1]
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
        assert _cosine(vector, reference) > 1 - COSINE_TOLERANCE
    unnormalized = llm.embed(TEXTS[0], normalize=False, dimensions=16)[0]
    reference = _transformers_hidden(model, tokenizer(TEXTS[0])["input_ids"])[-1][:16]
    assert np.allclose(unnormalized, reference, rtol=1e-3, atol=1e-4)


def test_mean_pooling_matches_transformers(tiny_embedding_dir: Path) -> None:
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny_embedding_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_embedding_dir)
    llm = LLM(str(tiny_embedding_dir), backend="reference", pooling="mean", show_progress=False)
    for text, vector in zip(TEXTS, llm.embed(TEXTS), strict=True):
        reference = _transformers_hidden(model, tokenizer(text)["input_ids"]).mean(axis=0)
        assert _cosine(vector, reference) > 1 - COSINE_TOLERANCE
