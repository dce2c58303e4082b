"""KV offload: the connector seam between the scheduler and stores of KV blocks outside the pool, and
its first implementation, the tiered store (kv_tiers.py: host RAM for a cache on a GPU, a disk folder).

The seam, in vLLM's spirit: the scheduler asks how many of a prompt's next full blocks a connector can
give back (`available`), gives it pool blocks to fill (`start_load`, done off the step on a loader
thread) and collects what has arrived (`finished_loads`); the engine hands it each block once the step
has computed it (`save`: the block's bytes are copied now, written by a writer thread, so a step never
waits on a disk). A block is named by its chain hash (token ids from the model's root, which carries the
weight version; a LoRA adapter's salt; images' digests), inside a namespace of everything else that
changes its bytes (`namespace_digest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kiln.backends.base import KVCache, KVCacheSpec
from kiln.runtime.block_pool import BlockHash
from kiln.runtime.kv_tiers import DiskTier, HostTier, KVTier, TierStats

logger = logging.getLogger(__name__)

WRITER_NICENESS = 19
DEFAULT_MAX_PENDING_BYTES = 256 * 2**20  # blocks copied out but not written yet; past this, saves are dropped


@dataclass(frozen=True)
class KVOffloadConfig:
    """`disk_dir`: the disk tier's folder (None: no disk tier), holding at most `disk_bytes`;
    `cpu_bytes`: a host-RAM tier (meant for a KV cache on a GPU). `identity`: the artifact and target
    the blocks come from (the caller's; blocks of another identity are never read)."""

    identity: str
    disk_dir: Path | None = None
    disk_bytes: int = 0
    cpu_bytes: int = 0
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES

    def __post_init__(self) -> None:
        if self.disk_dir is not None and self.disk_bytes < 1:
            raise ValueError(f"the disk tier needs a size in bytes, got {self.disk_bytes}")
        if self.cpu_bytes < 0:
            raise ValueError(f"the host-RAM tier's size must be >= 0 bytes, got {self.cpu_bytes}")


def namespace_digest(identity: str, spec: KVCacheSpec, block_size: int) -> bytes:
    """What, besides its tokens, decides a block's bytes: the artifact and target, and the KV cache's
    dtype and layout (its float8 scales are compiled into the artifact, so the identity covers them)."""
    described = {
        "identity": identity,
        "kv": [spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype],
        "block_size": block_size,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()


@dataclass(frozen=True)
class OffloadStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    write_error: str | None = None


class KVConnector(Protocol):
    def available(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first, this connector can load."""
        ...

    def start_load(self, key: str, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Fill pool blocks `block_ids` with the blocks `block_hashes`, off the step; `key` names the job
        in `finished_loads`."""
        ...

    def finished_loads(self) -> dict[str, int]:
        """Jobs done since last asked: key → how many blocks, from the first, were filled."""
        ...

    def wait_for_load(self, timeout: float) -> None:
        """Block until a job finishes or `timeout` seconds pass (the engine with nothing else to do)."""
        ...

    def save(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Keep these just-computed (pool block id, hash) blocks; never blocks on storage."""
        ...

    def bind(self, kv_cache: KVCache | None) -> None:
        """The KV cache blocks are read from and written to (None while the engine sleeps)."""
        ...

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the blocks saved so far are stored."""
        ...

    def stats(self) -> OffloadStats: ...

    def close(self) -> None:
        """Finish the writes queued, stop the threads."""
        ...


class TieredKVOffload:
    """The tiers in lookup order (host RAM, then disk); a block is saved to every tier, loaded from the
    first that holds it."""

    def __init__(self, tiers: Sequence[KVTier], max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.tiers = list(tiers)
        self.disk = next((tier for tier in self.tiers if isinstance(tier, DiskTier)), None)
        self.max_pending_bytes = max_pending_bytes
        self._kv_cache: KVCache | None = None
        # a block to write; an event to set once the writes before it are done; None: stop
        self._writes: queue.SimpleQueue[tuple[BlockHash, np.ndarray] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._loads: queue.SimpleQueue[tuple[str, list[BlockHash], list[int]] | None] = queue.SimpleQueue()
        self._pending: set[BlockHash] = set()  # queued for the disk, not written yet
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._done: dict[str, int] = {}
        self._done_event = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="kiln-kv-writer", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kiln-kv-loader", daemon=True)
        self._writer.start()
        self._loader.start()

    def bind(self, kv_cache: KVCache | None) -> None:
        self._kv_cache = kv_cache

    # -- lookup and load ------------------------------------------------------------------------

    def available(self, block_hashes: Sequence[BlockHash]) -> int:
        for count, block_hash in enumerate(block_hashes):
            if not any(tier.contains(block_hash) for tier in self.tiers):
                return count
        return len(block_hashes)

    def start_load(self, key: str, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self._loads.put((key, list(block_hashes), list(block_ids)))

    def finished_loads(self) -> dict[str, int]:
        with self._lock:
            done, self._done = self._done, {}
            self._done_event.clear()
        return done

    def wait_for_load(self, timeout: float) -> None:
        self._done_event.wait(timeout)

    def _load_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            key, block_hashes, block_ids = job
            loaded = 0
            try:
                loaded = self._load(block_hashes, block_ids)
            except Exception:  # a failed load costs a recompute, never the request
                logger.exception("loading offloaded KV blocks failed; they are recomputed")
            with self._lock:
                self._done[key] = loaded
                self._done_event.set()

    def _load(self, block_hashes: list[BlockHash], block_ids: list[int]) -> int:
        kv_cache = self._kv_cache
        if kv_cache is None:
            return 0
        for index, (block_hash, block_id) in enumerate(zip(block_hashes, block_ids, strict=True)):
            for position, tier in enumerate(self.tiers):
                payload = tier.get(block_hash)
                if payload is not None:
                    write_block(kv_cache, block_id, payload)
                    for upper in self.tiers[:position]:
                        upper.put(block_hash, payload)
                    break
            else:
                return index
        return len(block_hashes)

    # -- save -----------------------------------------------------------------------------------

    def save(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        kv_cache = self._kv_cache
        if kv_cache is None or not blocks:
            return
        disk = self.disk
        for block_id, block_hash in blocks:
            payload: np.ndarray | None = None
            for tier in self.tiers:
                if tier is disk:
                    continue
                if not tier.contains(block_hash):
                    payload = read_block(kv_cache, block_id) if payload is None else payload
                    tier.put(block_hash, memoryview(payload))
            if disk is None or not disk.writable or block_hash in self._pending or disk.contains(block_hash):
                continue
            if payload is None:
                payload = read_block(kv_cache, block_id)
            with self._lock:
                if self._pending_bytes + payload.nbytes > self.max_pending_bytes:
                    disk.stats.failures["dropped"] += 1
                    continue
                self._pending.add(block_hash)
                self._pending_bytes += payload.nbytes
            self._writes.put((block_hash, payload))

    def _write_loop(self) -> None:
        try:  # the step's threads first: writes take what CPU they leave (Linux: a thread's own nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while (item := self._writes.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            block_hash, payload = item
            try:
                if self.disk is not None:
                    self.disk.put(block_hash, memoryview(payload))
            except Exception:  # never the server's end: the block is simply not kept
                logger.exception("writing an offloaded KV block failed")
            with self._lock:
                self._pending.discard(block_hash)
                self._pending_bytes -= payload.nbytes

    # -- the rest -------------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the writes queued so far are done (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(done)
        done.wait(timeout)

    def stats(self) -> OffloadStats:
        tiers = {tier.name: tier.stats.copy() for tier in self.tiers}
        return OffloadStats(tiers, self.disk.write_error if self.disk else None)

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._loads.put(None)
        self._writer.join(timeout=30)
        self._loader.join(timeout=30)


DEFAULT_DISK_BYTES = 16 * 2**30


def default_disk_bytes(folder: Path) -> int:
    """The disk tier's size where none is given: 16 GiB, or half the free space of the folder's disk
    where that is less."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        usage = shutil.disk_usage(existing)
    except OSError:
        return DEFAULT_DISK_BYTES
    return max(1, min(DEFAULT_DISK_BYTES, usage.free // 2))


def open_offload(config: KVOffloadConfig, spec: KVCacheSpec, block_size: int) -> TieredKVOffload:
    namespace = namespace_digest(config.identity, spec, block_size)
    block_bytes = spec.bytes_per_block(block_size)
    tiers: list[KVTier] = []
    if config.cpu_bytes:
        tiers.append(HostTier(config.cpu_bytes, block_bytes))
    if config.disk_dir is not None:
        tiers.append(DiskTier(config.disk_dir, namespace, block_bytes, config.disk_bytes))
    if not tiers:
        raise ValueError("KV offload needs a disk folder or a host-RAM size")
    return TieredKVOffload(tiers, config.max_pending_bytes)


# -- blocks in and out of the KV cache [layers, 2, blocks, block_size, kv_heads, head_dim] ------------


def read_block(kv_cache: KVCache, block_id: int) -> np.ndarray:
    """A copy of one block's K/V as bytes (host memory)."""
    if isinstance(kv_cache, np.ndarray):
        return np.ascontiguousarray(kv_cache[:, :, block_id]).view(np.uint8).reshape(-1)
    block = kv_cache[:, :, block_id].contiguous()
    return _torch_bytes(block).cpu().numpy().reshape(-1)


def write_block(kv_cache: KVCache, block_id: int, payload: memoryview | bytes) -> None:
    """One block's K/V from its bytes (as `read_block` gave them)."""
    if isinstance(kv_cache, np.ndarray):
        shape = kv_cache[:, :, block_id].shape
        kv_cache[:, :, block_id] = np.frombuffer(payload, kv_cache.dtype).reshape(shape)
        return
    import torch

    block = kv_cache[:, :, block_id]
    source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    block.copy_(source.view(block.dtype).view(block.shape).to(block.device))


def _torch_bytes(tensor: Any) -> Any:
    import torch

    return tensor.reshape(-1).view(torch.uint8)
