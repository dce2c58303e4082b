"""Which KV blocks each sequence holds; prefix-cache hits; hashing blocks as they fill."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kiln.runtime.block_pool import BlockHash, BlockPool, KVBlock, chain_hash, model_root_hash


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, model_id: str, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.root_hash = model_root_hash(model_id)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(seq_id, [])]

    def _root(self, salt: str | None) -> BlockHash:
        """Where a chain starts: the model's root, or for blocks computed with something else that changes
        their K/V (a LoRA adapter) a root of its own."""
        return self.root_hash if salt is None else hashlib.sha256(self.root_hash + salt.encode()).digest()

    def _full_block_hashes(
        self, token_ids: Sequence[int], count: int, known: list[BlockHash], salt: str | None = None
    ) -> list[BlockHash]:
        hashes = list(known[:count])
        parent = hashes[-1] if hashes else self._root(salt)
        size = self.block_size
        for index in range(len(hashes), count):
            parent = chain_hash(parent, token_ids[index * size : (index + 1) * size])
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> list[KVBlock]:
        """The longest run of cached full blocks at the start of `token_ids` (computed with `salt`),
        leaving at least one token to compute (a step must produce the logits of the last token)."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = self._root(salt)
        for index in range(max_blocks):
            parent = chain_hash(parent, token_ids[index * self.block_size : (index + 1) * self.block_size])
            block = self.pool.lookup(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq_id: str, num_tokens: int, cached: Sequence[KVBlock] = ()) -> bool:
        held = len(self._blocks.get(seq_id, ())) + len(cached)
        revived = sum(1 for block in cached if block.ref_count == 0)  # leaves the free list when touched
        return self.blocks_needed(num_tokens) - held <= self.pool.num_free - revived

    def allocate(self, seq_id: str, num_tokens: int, cached: Sequence[KVBlock] = ()) -> bool:
        """Hold enough blocks for `num_tokens` tokens, starting with `cached` hits; False if none free."""
        if not self.can_allocate(seq_id, num_tokens, cached):
            return False
        blocks = self._blocks.setdefault(seq_id, [])
        if cached:
            self.pool.touch(cached)
            blocks.extend(cached)
            self._hashes[seq_id] = [block.block_hash for block in cached if block.block_hash is not None]
        missing = self.blocks_needed(num_tokens) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.allocate(missing))
        return True

    def prefix_hashes(self, token_ids: Sequence[int], count: int, salt: str | None = None) -> list[BlockHash]:
        """The chain hashes of the first `count` full blocks of `token_ids` (computed with `salt`)."""
        return self._full_block_hashes(token_ids, count, [], salt)

    def cache_full_blocks(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, salt: str | None = None
    ) -> list[tuple[int, BlockHash]]:
        """Register every block of `seq_id` whose tokens are all computed now; the (block id, hash) of
        those that became the cached copy of their hash."""
        if not self.pool.enable_caching:
            return []
        blocks = self._blocks[seq_id]
        num_full = min(num_computed // self.block_size, len(blocks))
        known = self._hashes.setdefault(seq_id, [])
        if num_full <= len(known):
            return []
        hashes = self._full_block_hashes(token_ids, num_full, known, salt)
        registered = []
        for index in range(len(known), num_full):
            if self.pool.register(blocks[index], hashes[index]):
                registered.append((blocks[index].block_id, hashes[index]))
        self._hashes[seq_id] = hashes
        return registered

    def register_loaded(self, seq_id: str, first: int, hashes: Sequence[BlockHash]) -> None:
        """Blocks `first`, `first + 1`, ... of `seq_id` were filled from a lower tier: cache them under
        `hashes`."""
        blocks = self._blocks[seq_id]
        for offset, block_hash in enumerate(hashes):
            self.pool.register(blocks[first + offset], block_hash)

    def free(self, seq_id: str) -> None:
        blocks = self._blocks.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self.pool.free(reversed(blocks))

    def live_references(self) -> dict[int, int]:
        """Block id → number of sequences holding it (for consistency checks)."""
        counts: dict[int, int] = {}
        for blocks in self._blocks.values():
            for block in blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
        return counts
