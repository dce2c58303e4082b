"""The KV block pool: ref counts, a null block, prefix-cache lookup by block hash, LRU eviction.

Allocation order: first a freed block that holds no cached prefix (nothing is lost by reusing it), then
a freed block with a cached prefix, least recently freed first, dropping its hash, and only then a block
never used yet. A block whose ref count drops to 0 keeps its hash (its K/V stay valid and a later
request with the same prefix may take it back until its block is reused). Callers free a request's
blocks tail first, so a prefix's last blocks are evicted before its first.

NOTE: the KV tensor is allocated untouched (zero pages), so a fresh block costs memory only once it is
written. Reusing freed blocks before fresh ones keeps the cache's resident memory at the most blocks
ever held at once, not at its whole reservation (16 sequences of 8k tokens of a small model is GBs);
the price is that cached prefixes live only within that footprint.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def model_root_hash(model_id: str) -> BlockHash:
    """The hash every chain starts from, so two models never share cached blocks."""
    return hashlib.sha256(b"kiln-model:" + model_id.encode()).digest()


def chain_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block: its parent's hash and its own tokens."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered for prefix caching


class BlockPool:
    """`num_blocks` blocks; block 0 is the null block, used to pad block tables and never handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_count = 1
        self.enable_caching = enable_caching
        self._fresh: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._free_uncached: OrderedDict[int, KVBlock] = OrderedDict()
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()  # LRU: least recently freed first
        self._cached: dict[BlockHash, KVBlock] = {}
        # told of a cached block about to be reused (its K/V still intact): where a lower tier takes it
        self.on_evict: Callable[[KVBlock], None] | None = None

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._free_uncached) + len(self._free_cached)

    def _is_free(self, block: KVBlock) -> bool:
        return any(block.block_id in queue for queue in (self._fresh, self._free_uncached, self._free_cached))

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some request."""
        return 1.0 - self.num_free / self.num_usable

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} blocks with {self.num_free} free")
        taken = []
        for _ in range(count):
            queue = next(q for q in (self._free_uncached, self._free_cached, self._fresh) if q)
            _, block = queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to blocks found in the prefix cache (reviving them if they were free)."""
        for block in blocks:
            if block.ref_count == 0:
                for queue in (self._free_cached, self._free_uncached):
                    queue.pop(block.block_id, None)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                cached = block.block_hash is not None and self._cached.get(block.block_hash) is block
                (self._free_cached if cached else self._free_uncached)[block.block_id] = block

    def register(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Record a full block under its hash; the first block with a given hash stays the cached one.
        True where `block` became the cached one."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self._cached.setdefault(block_hash, block) is block

    def cached_blocks(self) -> list[KVBlock]:
        """The blocks that hold a cached prefix now, in use or free."""
        return list(self._cached.values())

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their K/V, but nothing will hit them)."""
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self._cached[block.block_hash]
            block.block_hash = None

    def check_consistency(self, live_references: dict[int, int]) -> None:
        """Raise if ref counts differ from `live_references` (block id → holders) or the free list is off."""
        for block in self.blocks[1:]:
            expected = live_references.get(block.block_id, 0)
            if block.ref_count != expected:
                raise AssertionError(
                    f"block {block.block_id} has ref count {block.ref_count}, expected {expected}"
                )
            if (block.ref_count == 0) != self._is_free(block):
                raise AssertionError(f"block {block.block_id} free-list membership is wrong")
