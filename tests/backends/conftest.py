"""What every backend's tests compare on: tiny random-weight HF models of each supported architecture
(made with transformers, saved with `save_pretrained`, loaded back through our HF loader) and one
ragged batch of 3 sequences mixing decode, a fresh prefill and a chunked prefill over non-contiguous
blocks of 16, prompts crossing block boundaries."""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers
from tokenizers import Tokenizer, models

from kiln.backends.base import Executable
from kiln.frontend.capture import capture_weights
from kiln.frontend.load import load_model
from kiln.ir import Program, StepInputs
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.passes import PassManager, PassOptions, pipeline

BLOCK_SIZE = 16
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
LONGROPE = {  # head_dim 16: 8 frequency pairs
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.2, 1.6, 2.0, 2.5, 3.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
}
TINY_MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
    "phi3_longrope": (  # every test sequence is longer than the original 8 positions: the long factors
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"pad_token_id": 0, "original_max_position_embeddings": 8, "rope_scaling": LONGROPE},
    ),
    "gemma3": (  # a window shorter than the prompts, soft-capping on, its own attention scale
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 32,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": True,
        },
    ),
    # mixture of experts: 4 or 8 experts, top 2; Qwen3-MoE with a dense layer, OLMoE unnormalised
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "olmoe": (
        transformers.OlmoeConfig,
        transformers.OlmoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 2},
    ),
}

# The ragged batch: step 1 prefills a[:20] and c[:10]; step 2 decodes a, prefills b from scratch and
# continues c across two block boundaries.
RAGGED_LENGTHS = {"a": 21, "b": 35, "c": 35}
RAGGED_TABLES = {"a": [3, 7], "b": [1, 5, 9], "c": [2, 8, 4]}
RAGGED_CACHE_BLOCKS = 10


def save_tiny_hf(kind: str, path: Path, overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """A random-weight transformers model of `kind` (its config `overrides` applied), saved with its
    tokenizer at `path`."""
    config_cls, model_cls, extra = TINY_MODELS[kind]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra, **(overrides or {})})
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: make them random too
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 256)}}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    ).save_pretrained(path)
    return model


def tiny_program(kind: str, path: Path, opt_level: int | None = None) -> Program:
    """The tiny model of `kind` saved at `path`, loaded and captured; then pipeline O`opt_level`, if given."""
    save_tiny_hf(kind, path)
    source = load_model(str(path))
    captured = capture_weights(source.config, source.float_weights())
    program = Program(captured.graph, captured.weights)
    if opt_level is None:
        return program
    return PassManager(pipeline(opt_level, PassOptions())).run(program)[0]


def ragged_inputs(seed: int) -> tuple[dict[str, list[int]], StepInputs, StepInputs]:
    """(the three sequences' tokens, step 1, step 2) of the ragged batch."""
    generator = torch.Generator().manual_seed(seed)
    tokens = {
        name: torch.randint(1, 256, (n,), generator=generator).tolist() for name, n in RAGGED_LENGTHS.items()
    }
    first = build_step_inputs(
        [
            SequenceSlice(tokens["a"][:20], 0, RAGGED_TABLES["a"]),
            SequenceSlice(tokens["c"][:10], 0, RAGGED_TABLES["c"]),
        ],
        BLOCK_SIZE,
    )
    second = build_step_inputs(
        [
            SequenceSlice(tokens["a"][20:], 20, RAGGED_TABLES["a"]),
            SequenceSlice(tokens["b"], 0, RAGGED_TABLES["b"]),
            SequenceSlice(tokens["c"][10:], 10, RAGGED_TABLES["c"]),
        ],
        BLOCK_SIZE,
    )
    return tokens, first, second


def run_ragged(executables: list[Executable], seed: int) -> list[list[torch.Tensor]]:
    """Both steps of the ragged batch on each executable: [step 1 logits, step 2 logits, final cache]."""
    _, first, second = ragged_inputs(seed)
    results = []
    for executable in executables:
        cache = executable.kv_cache_spec.allocate(RAGGED_CACHE_BLOCKS, BLOCK_SIZE)
        results.append(
            [
                torch.from_numpy(executable.step(first, cache)),
                torch.from_numpy(executable.step(second, cache)),
                cache,
            ]
        )
    return results


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_kind(request: pytest.FixtureRequest) -> str:
    """Each tiny architecture in turn."""
    return request.param


@pytest.fixture(scope="session")
def tiny_hf() -> Callable[..., torch.nn.Module]:
    return save_tiny_hf


@pytest.fixture(scope="session")
def make_tiny_program() -> Callable[..., Program]:
    return tiny_program


@pytest.fixture(scope="session")
def ragged() -> Callable[[int], tuple[dict[str, list[int]], StepInputs, StepInputs]]:
    return ragged_inputs


@pytest.fixture(scope="session")
def ragged_run() -> Callable[[list[Executable], int], list[list[torch.Tensor]]]:
    return run_ragged


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks_of(world: int, work: Callable[[int], Any], timeout: float = 120) -> list[Any]:
    """`work(rank)` in `world` forked processes joined by a gloo group; their results by rank."""
    context = multiprocessing.get_context("fork")
    results: Any = context.Queue()
    port = _free_port()

    def main(rank: int) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            # by value: a queue would share tensors through file descriptors that die with this process
            results.put((rank, pickle.dumps(work(rank))))
        finally:
            dist.destroy_process_group()

    processes = [context.Process(target=main, args=(rank,)) for rank in range(world)]
    for process in processes:
        process.start()
    collected = {}
    try:
        for _ in range(world):
            rank, result = results.get(timeout=timeout)
            collected[rank] = pickle.loads(result)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(collected))} gave no result in {timeout} s")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes)
    return [collected[rank] for rank in range(world)]


@pytest.fixture(scope="session")
def run_ranks() -> Callable[..., list[Any]]:
    """`run_ranks(world, work)`: `work(rank)` in `world` forked processes joined by a gloo group."""
    return run_ranks_of
