"""LoRA adapters in the runtime: the slots of the step's tables (fill, evict, wait, unload), the checks
that refuse an adapter for another base, and an engine mixing adapters in one batch (each row's tokens
as alone; the prefix cache never shared across adapters). The tiny model, with random adapters."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kiln.backends.lora_tables import LoRASpec
from kiln.ir.adapters import AdapterWeights
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.lora import AdapterSlots, LoRAConfig, LoRAError, LoRARequest
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from tests.conftest import TINY_CONFIG


@pytest.fixture(scope="module")
def lora_executable() -> Any:
    from kiln.backends.reference import ReferenceExecutable
    from kiln.compiler.build import optimize
    from kiln.compiler.options import PipelineOptions
    from tests.conftest import tiny_weights

    program = optimize(TINY_CONFIG, tiny_weights(), PipelineOptions(enable_lora=True)).program
    return ReferenceExecutable(program.graph, program.weights)


def random_adapter(
    spec: LoRASpec, seed: int, rank: int, modules: tuple[str, ...] | None = None
) -> AdapterWeights:
    generator = np.random.default_rng(seed)
    updates = {}
    for module in spec.modules:
        if modules is not None and module.name not in modules:
            continue
        for layer in range(module.layers):
            a = generator.normal(0, 0.3, (rank, module.in_features)).astype(np.float32)
            b = generator.normal(0, 0.3, (module.out_features, rank)).astype(np.float32)
            updates[(module.name, layer)] = (a, b)
    return AdapterWeights(f"random-{seed}", updates)


def slots_of(
    spec: LoRASpec, adapters: dict[str, AdapterWeights], max_loras: int, rank: int = 8
) -> AdapterSlots:
    config = LoRAConfig(max_loras, rank)
    return AdapterSlots(spec, config, spec.allocate(max_loras, rank), adapters.__getitem__)


def test_slots_fill_evict_the_least_recently_used_free_one_and_refuse_when_all_held(
    lora_executable: Any,
) -> None:
    spec = lora_executable.lora_spec
    weights = {name: random_adapter(spec, seed, 4) for seed, name in enumerate("abc")}
    slots = slots_of(spec, weights, max_loras=2)
    for name in "abc":
        slots.register(LoRARequest(name, ord(name), name))
    assert (slots.acquire("a"), slots.acquire("b")) == (0, 1)
    assert slots.acquire("c") is None  # both slots held by running sequences
    slots.release("a")
    assert slots.acquire("c") == 0 and slots.adapters["a"].slot is None
    a_table, b_table = slots.tables["lora_a.q_proj"], slots.tables["lora_b.q_proj"]
    a, b = weights["c"].updates[("q_proj", 1)]
    np.testing.assert_array_equal(a_table[1, 0, :4], a)
    np.testing.assert_array_equal(b_table[1, 0, :4], b.T)
    assert not a_table[1, 0, 4:].any() and not b_table[1, 0, 4:].any()  # past the adapter's rank
    assert slots.acquire("b") == 1  # still there: no copy
    with pytest.raises(LoRAError, match="in use by 2 running"):
        slots.unregister("b")
    slots.release("b")
    slots.release("b")
    slots.unregister("b")
    assert "b" not in slots.adapters


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        ("rank", "rank 16, more than max_lora_rank 8"),
        ("features", "maps 32 -> 40 features, this model's 32 -> 32: the adapter is for another base model"),
        ("layers", "this model has 2 layers"),
        ("module", "lm_head of layer 0: this model's step adapts"),
    ],
)
def test_an_adapter_for_another_base_is_refused_naming_what_differs(
    lora_executable: Any, adapter: str, message: str
) -> None:
    spec = lora_executable.lora_spec
    weights = {
        "rank": random_adapter(spec, 0, 16),
        "features": AdapterWeights(
            "x", {("o_proj", 0): (np.zeros((4, 32), np.float32), np.zeros((40, 4), np.float32))}
        ),
        "layers": AdapterWeights(
            "x", {("o_proj", 5): (np.zeros((4, 32), np.float32), np.zeros((32, 4), np.float32))}
        ),
        "module": AdapterWeights(
            "x", {("lm_head", 0): (np.zeros((4, 32), np.float32), np.zeros((256, 4), np.float32))}
        ),
    }
    slots = slots_of(spec, weights, max_loras=2)
    with pytest.raises(LoRAError, match=message.replace("(", r"\(")):
        slots.register(LoRARequest(adapter, 1, adapter))
    assert not slots.adapters


def lora_engine(
    executable: Any, tokenizer: Any, adapters: dict[str, AdapterWeights], max_loras: int = 3
) -> LLMEngine:
    config = EngineConfig(block_size=4, num_blocks=96, scheduler=SchedulerConfig(8, 64))
    return LLMEngine(
        executable,
        tokenizer,
        "tiny",
        TINY_CONFIG.max_position_embeddings,
        config,
        lora=LoRAConfig(max_loras, 8),
        adapter_reader=adapters.__getitem__,
    )


PROMPTS = [[5, 17, 42, 90, 3, 7, 11, 60, 2], [20, 1, 9, 33, 70], [8, 8, 15, 31, 4, 19, 77]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    for index, (prompt, adapter) in enumerate(jobs):
        request = LoRARequest(adapter, 1 + "abc".index(adapter), adapter) if adapter else None
        engine.add_request(f"r{index}", prompt, GREEDY, lora_request=request)
    finished = {output.request_id: output for output in engine.run_to_completion()}
    return [finished[f"r{i}"].outputs[0].token_ids for i in range(len(jobs))]


def test_a_batch_of_three_adapters_and_the_base_gives_each_row_its_tokens_alone(
    lora_executable: Any, tiny_model: Any
) -> None:
    spec = lora_executable.lora_spec
    adapters = {name: random_adapter(spec, seed, 2 + 2 * seed) for seed, name in enumerate("abc")}
    tokenizer = tiny_model[1]
    jobs = [(prompt, adapter) for prompt in PROMPTS for adapter in (None, "a", "b", "c")]
    together = run(lora_engine(lora_executable, tokenizer, adapters), jobs)
    alone = [run(lora_engine(lora_executable, tokenizer, adapters), [job])[0] for job in jobs]
    assert together == alone
    assert len({tuple(tokens) for tokens in together}) > 2 * len(PROMPTS)  # the adapters change tokens
    # one slot for three adapters: each request waits for the slot, the tokens are the same
    assert run(lora_engine(lora_executable, tokenizer, adapters, max_loras=1), jobs) == together


def test_the_prefix_cache_never_shares_blocks_across_adapters(lora_executable: Any, tiny_model: Any) -> None:
    spec = lora_executable.lora_spec
    adapters = {"a": random_adapter(spec, 1, 4), "b": random_adapter(spec, 2, 4)}
    engine = lora_engine(lora_executable, tiny_model[1], adapters)
    prompt = list(range(3, 40))  # 37 tokens: 9 full blocks of 4
    cached = []
    # (freed blocks are reused before fresh ones, so each prefix is looked up right after its twin)
    for index, adapter in enumerate([None, None, "a", "a", "b"]):
        request = LoRARequest(adapter, 1, adapter) if adapter else None
        engine.add_request(f"r{index}", prompt, GREEDY, lora_request=request)
        (output,) = [o for o in engine.run_to_completion() if o.request_id == f"r{index}"]
        cached.append(output.num_cached_tokens)
    assert cached == [0, 36, 0, 36, 0]


def test_an_adapters_cache_salt_is_its_content(lora_executable: Any) -> None:
    """The same adapter's blocks are shared across loads (and, with an offload folder, restarts); another
    adapter under the same name never gets them."""
    spec = lora_executable.lora_spec
    same, other = random_adapter(spec, 1, 4), random_adapter(spec, 2, 4)
    assert same.digest() == random_adapter(spec, 1, 4).digest() != other.digest()
    slots = slots_of(spec, {"a": same, "b": other}, max_loras=2)
    salts = [slots.read(LoRARequest(name, 1, name)).cache_salt for name in ("a", "a", "b")]
    assert salts[0] == salts[1] != salts[2]


def test_unloading_an_adapter_a_request_waits_for_is_refused(lora_executable: Any, tiny_model: Any) -> None:
    spec = lora_executable.lora_spec
    engine = lora_engine(lora_executable, tiny_model[1], {"a": random_adapter(spec, 1, 4)})
    engine.add_request("r0", PROMPTS[0], GREEDY, lora_request=LoRARequest("a", 1, "a"))
    with pytest.raises(LoRAError, match="0 running and 1 waiting"):
        engine.remove_lora("a")
    engine.step()
    with pytest.raises(LoRAError, match="1 running and 0 waiting"):
        engine.remove_lora("a")
    engine.run_to_completion()
    engine.remove_lora("a")
    assert engine.adapters is not None and not engine.adapters.adapters


def test_an_engine_without_lora_in_its_step_refuses_adapters(tiny_model: Any) -> None:
    with pytest.raises(LoRAError, match="compiled without --enable-lora"):
        LLMEngine(tiny_model[0], tiny_model[1], "tiny", 512, lora=LoRAConfig(), adapter_reader=str)
