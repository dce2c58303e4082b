"""Engine settings, and sizing the KV cache from a memory budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.backends.base import KVCacheSpec
from kiln.runtime.kv_offload import KVOffloadConfig
from kiln.runtime.pooling import POOLING_TYPES, PoolingType
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.speculative import SpeculativeConfig

DEFAULT_KV_CACHE_FRACTION = 0.5  # the most of the host memory available now that the KV cache may take
DEFAULT_GPU_KV_CACHE_FRACTION = 0.9  # ... of a GPU's free memory (weights loaded), as vLLM's 0.9
DEFAULT_MAX_MODEL_LEN = 8192  # a longer model context is used only when asked for (--max-model-len)
DEFAULT_BLOCK_SIZE = 16  # tokens a KV cache block holds


@dataclass(frozen=True)
class EngineConfig:
    """The KV cache holds `max_num_seqs` sequences of `max_model_len` tokens, at most `kv_cache_fraction`
    of the memory available now where the cache lives (None: half the host's, 90% of a GPU's free
    memory); `kv_cache_memory` (bytes) or `num_blocks` set it instead. `max_model_len` None: the
    model's context, up to DEFAULT_MAX_MODEL_LEN. `kv_offload`: where full blocks go besides the pool."""

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    num_blocks: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    kv_offload: KVOffloadConfig | None = None  # lower tiers of the prefix cache (kv_offload.py)
    pooling: PoolingType = "last"  # how an embedding request pools, unless it says (runtime/pooling.py)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


def _on_host(device: str) -> bool:
    return str(device).split(":")[0] == "cpu"


def device_free_memory(device: str) -> int:
    """Bytes free now where a KV cache on `device` would live: the host's MemAvailable, or the GPU's
    free memory (after the weights were loaded)."""
    if _on_host(device):
        return available_memory_bytes()
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass kv_cache_memory")


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int  # block 0, the null block, included
    block_size: int
    bytes: int
    why: str

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> str:
        return (
            f"{self.num_blocks - 1:,} blocks of {self.block_size} tokens = {self.num_tokens:,} tokens, "
            f"{self.bytes / 2**20:,.0f} MiB ({self.why})"
        )


def plan_kv_cache(
    config: EngineConfig,
    specs: Sequence[KVCacheSpec],
    max_model_len: int,
    device: str = "cpu",
    available: int | None = None,
) -> KVCachePlan:
    """The KV cache's size: what `config` asks for, else enough for max_num_seqs full-length sequences,
    capped at kv_cache_fraction of the memory available now on `device` (`available` bytes where
    given). `specs`: the caches that share the block tables (the model's, and a draft model's)."""
    per_block = sum(spec.bytes_per_block(config.block_size) for spec in specs)

    def made(num_blocks: int, why: str) -> KVCachePlan:
        return KVCachePlan(num_blocks, config.block_size, num_blocks * per_block, why)

    if config.num_blocks is not None:
        return made(config.num_blocks, "num_blocks")
    if config.kv_cache_memory is not None:
        blocks = config.kv_cache_memory // per_block
        if blocks < 2:
            raise ValueError(
                f"kv_cache_memory of {config.kv_cache_memory} bytes holds fewer than 2 blocks; give at least "
                f"{2 * per_block}"
            )
        return made(int(blocks), "kv_cache_memory")
    seqs = config.scheduler.max_num_seqs
    needed = seqs * -(-max_model_len // config.block_size) + 1
    on_gpu = not _on_host(device)
    if available is None:
        available = device_free_memory(device)
    fraction = config.kv_cache_fraction or (
        DEFAULT_GPU_KV_CACHE_FRACTION if on_gpu else DEFAULT_KV_CACHE_FRACTION
    )
    where = f"free on {device}" if on_gpu else "available"
    cap = int(available * fraction) // per_block
    if cap < 2:
        raise ValueError(
            f"{available:,} bytes of memory are {where}; the KV cache needs at least {2 * per_block:,}"
        )
    if needed <= cap:
        return made(needed, f"{seqs} sequences of {max_model_len:,} tokens")
    return made(
        int(cap),
        f"{seqs} sequences of {max_model_len:,} tokens would need {needed * per_block / 2**20:,.0f} MiB; "
        f"capped at {fraction:.0%} of the {available / 2**30:.1f} GiB {where}",
    )
