"""Engine settings, and sizing the KV cache from a memory budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.backends.base import KVCacheSpec
from kiln.runtime.scheduler import SchedulerConfig

DEFAULT_KV_CACHE_FRACTION = 0.1


@dataclass(frozen=True)
class EngineConfig:
    """`kv_cache_memory` (bytes) sizes the KV cache; without it, `kv_cache_fraction` of the memory
    available now. `num_blocks` overrides both (tests). `max_model_len` None: the model's context."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION
    num_blocks: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory")


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    budget = config.kv_cache_memory
    if budget is None:
        budget = int(available_memory_bytes() * config.kv_cache_fraction)
    blocks = budget // spec.bytes_per_block(config.block_size)
    if blocks < 2:
        needed = 2 * spec.bytes_per_block(config.block_size)
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds fewer than 2 blocks; give at least {needed}"
        )
    return int(blocks)
