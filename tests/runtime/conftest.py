"""A tiny random-weight Llama on the reference backend, with a small word-level tokenizer: real
engine steps in milliseconds, for tests that need many of them."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.config import ModelConfig
from kiln.frontend.models import model_class
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.tokenizer import Tokenizer

TINY_VOCAB = 96
TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def _tiny_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, TINY_VOCAB)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    data = json.loads(backend.to_str())
    data["added_tokens"] = [
        {
            "id": 1,
            "content": "</s>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    return Tokenizer(json.dumps(data), None, None, "</s>", False, [1])


@pytest.fixture(scope="session")
def tiny_model() -> tuple[ReferenceExecutable, Tokenizer]:
    with torch.device("meta"):
        shapes = model_class(TINY_CONFIG)(TINY_CONFIG).state_dict()
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(t.shape, generator=generator) * 0.5 for name, t in shapes.items()}
    captured = capture_weights(TINY_CONFIG, weights)
    return ReferenceExecutable(captured.graph, captured.weights), _tiny_tokenizer()


@pytest.fixture
def make_tiny_engine(tiny_model):
    def make(
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        enable_prefix_caching: bool = True,
    ) -> LLMEngine:
        executable, tokenizer = tiny_model
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
        )
        return LLMEngine(executable, tokenizer, "tiny", TINY_CONFIG.max_position_embeddings, config)

    return make
