"""The model runner: what the engine computes with. It owns the executable, the KV cache, the LoRA
tables and the executable's inputs that the runtime owns, swaps the executable for one with other
weights, and sleeps (hands the cache, then the weights, back). The engine (engine.py) keeps scheduling,
sampling and outputs, and asks the runner to run a step's inputs (vLLM v1's EngineCore / ModelRunner
split, at our size)."""

from __future__ import annotations

from kiln.backends.base import Executable, Hidden, KVCache, Logits
from kiln.backends.lora_tables import LoRASpec, LoRATables
from kiln.ir.step import StepInputs, StepSignature


class ModelRunner:
    def __init__(self, executable: Executable, num_blocks: int, block_size: int) -> None:
        self.executable = executable
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache: KVCache | None = self._allocate_cache()
        self.lora_tables: LoRATables = {}  # allocated by `allocate_lora_tables`
        self.asleep = 0  # the sleep level: 0 awake, 1 without a KV cache, 2 without weights too

    @property
    def signature(self) -> StepSignature:
        return self.executable.signature

    @property
    def lora_spec(self) -> LoRASpec | None:
        """The LoRA tables the step takes, None for a step compiled without."""
        return self.executable.lora_spec

    def allocate_lora_tables(self, spec: LoRASpec, slots: int, rank: int) -> LoRATables:
        """Zeroed tables for `slots` adapters of rank up to `rank` where the executable reads them, passed
        to every step from now on (adapters are written into them in place)."""
        self.lora_tables = spec.allocate(slots, rank, self.executable.kv_cache_device)
        return self.lora_tables

    def step(self, inputs: StepInputs) -> Logits:
        return self.executable.step(self._with_owned(inputs), self._cache())

    def embed(self, inputs: StepInputs) -> Hidden:
        return self.executable.embed(self._with_owned(inputs), self._cache())

    def _with_owned(self, inputs: StepInputs) -> StepInputs:
        return inputs.with_optional(self.lora_tables) if self.lora_tables else inputs

    def _cache(self) -> KVCache:
        if self.kv_cache is None:
            raise RuntimeError("the engine is asleep: wake it up before stepping")
        return self.kv_cache

    def _allocate_cache(self) -> KVCache:
        executable = self.executable
        return executable.kv_cache_spec.allocate(self.num_blocks, self.block_size, executable.kv_cache_device)

    # -- weights and sleep (runtime/live_weights.py) ----------------------------------------------------

    def replace_executable(self, executable: Executable) -> Executable:
        """Run `executable` (the same compiled code with other weights) from the next step; the old one
        is returned."""
        _check_same_step(self.executable, executable)
        old, self.executable = self.executable, executable
        return old

    def sleep(self, level: int) -> Executable | None:
        """Level 1 frees the KV cache; level 2 the weights too (returned: the caller lets them go)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.executable.release_kv_cache()
        self.kv_cache = None
        dropped = None
        if level == 2 and self.asleep < 2:
            dropped, self.executable = self.executable, _WeightsDropped(self.executable)
        self.asleep = max(self.asleep, level)
        return dropped

    def wake_up(self) -> bool:
        """A zeroed KV cache again (True where one was allocated); after level 2 the weights must have
        been replaced first."""
        if self.weights_dropped:
            raise RuntimeError("the weights were dropped (sleep level 2): replace them before waking up")
        allocated = self.kv_cache is None
        if allocated:
            self.kv_cache = self._allocate_cache()
        self.asleep = 0
        return allocated

    @property
    def weights_dropped(self) -> bool:
        return isinstance(self.executable, _WeightsDropped)


class _WeightsDropped(Executable):
    """What a level-2 sleep leaves of an executable: its signature and where its cache lives; no step."""

    def __init__(self, executable: Executable) -> None:
        self.signature = executable.signature
        self.kv_cache_device = executable.kv_cache_device

    def step(self, inputs: StepInputs, kv_cache: KVCache) -> Logits:
        raise RuntimeError("the weights were dropped (sleep level 2)")


def _check_same_step(serving: Executable, new: Executable) -> None:
    """New weights must come with the same compiled step: same KV cache, where, and LoRA tables."""
    for what, old, now in (
        ("KV cache", serving.kv_cache_spec, new.kv_cache_spec),
        ("KV cache device", serving.kv_cache_device, new.kv_cache_device),
        ("LoRA tables", LoRASpec.of_signature(serving.signature), LoRASpec.of_signature(new.signature)),
    ):
        if old != now:
            raise ValueError(f"the new executable's {what} ({now}) is not the served one's ({old})")
