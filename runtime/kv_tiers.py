"""The prefix cache's lower tiers: host RAM and a disk folder, each an LRU store of whole KV blocks
(their bytes) by chain hash, bounded in bytes.

The disk tier keeps one file per block (kv_block_file.py) under
`FOLDER/kiln-kv-v1/<namespace>/<2 hex>/<hash>.kvb`, so artifacts never see each other's blocks and a
restarted server finds its own. A block is written to a temporary file of the writer's own and renamed
into place (atomic on POSIX): a reader sees a whole file or none, so servers sharing the folder need no
lock, and a server killed while writing leaves only its temporary file (removed by the next start once
its writer's process is gone). Every read checks the header and CRC; a foreign, truncated or corrupt
file is counted and not used (the block is recomputed and written over it). A write that fails (full,
read-only, gone) stops this tier's writes for the rest of the process; reads go on.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kiln.runtime.block_pool import BlockHash
from kiln.runtime.kv_block_file import HEADER_BYTES, BlockFileError, decode, encode_header

logger = logging.getLogger(__name__)

LAYOUT_VERSION = "kiln-kv-v1"
SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"
_TMP_NAME = re.compile(r"\.[0-9a-f]{64}\.(\d+)\.\d+\.tmp")


@dataclass
class TierStats:
    hits: int = 0  # blocks read back from this tier
    read_bytes: int = 0
    written_bytes: int = 0
    stored_blocks: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # foreign, truncated, corrupt, write, dropped

    def copy(self) -> TierStats:
        return TierStats(
            self.hits, self.read_bytes, self.written_bytes, self.stored_blocks, Counter(self.failures)
        )


class KVTier(Protocol):
    name: str
    stats: TierStats

    def contains(self, block_hash: BlockHash) -> bool: ...

    def get(self, block_hash: BlockHash) -> memoryview | None:
        """The block's bytes, or None where it is missing or unusable (counted in `stats.failures`)."""
        ...

    def put(self, block_hash: BlockHash, payload: memoryview) -> None: ...


class HostTier:
    """Blocks in host memory (for a KV cache on a GPU), least recently used dropped first."""

    name = "cpu"

    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.capacity_blocks = capacity_bytes // block_bytes
        self.stats = TierStats()
        self._blocks: OrderedDict[BlockHash, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def get(self, block_hash: BlockHash) -> memoryview | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
            if payload is None:
                return None
            self._blocks.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.read_bytes += len(payload)
        return memoryview(payload)

    def put(self, block_hash: BlockHash, payload: memoryview) -> None:
        if self.capacity_blocks < 1:
            return
        data = bytes(payload)
        with self._lock:
            self._blocks[block_hash] = data
            self._blocks.move_to_end(block_hash)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
            self.stats.stored_blocks = len(self._blocks)
        self.stats.written_bytes += len(data)


class DiskTier:
    """Block files in `root`'s folder for `namespace`, at most `capacity_bytes` of them."""

    name = "disk"

    def __init__(self, root: Path, namespace: bytes, block_bytes: int, capacity_bytes: int) -> None:
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + block_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self.folder = Path(root) / LAYOUT_VERSION / namespace.hex()[:32]
        self.stats = TierStats()
        self.write_error: str | None = None  # why writes stopped, once they have
        self._index: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self._unusable: set[BlockHash] = set()  # files that failed a read: written again when computed
        self._lock = threading.Lock()
        if self.capacity_blocks < 1:
            logger.warning(
                "the KV offload folder's size (%d bytes) holds no block of %d bytes: nothing is written",
                capacity_bytes,
                self.file_bytes,
            )
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._stop_writing(error)
        self._scan()

    @property
    def writable(self) -> bool:
        return self.write_error is None

    def path_of(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    def _scan(self) -> None:
        """Index the blocks already here (oldest first) and remove the temporary files of writers that
        are gone."""
        found: list[tuple[float, BlockHash]] = []
        if not self.folder.is_dir():
            return
        for sub in os.scandir(self.folder):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    self._remove_orphan(entry.path, entry.name)
                elif entry.name.endswith(SUFFIX):
                    try:
                        block_hash = bytes.fromhex(entry.name[: -len(SUFFIX)])
                        found.append((entry.stat().st_mtime, block_hash))
                    except (ValueError, OSError):
                        continue
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        self.stats.stored_blocks = len(self._index)
        if self.writable:
            self._evict_beyond(self.capacity_blocks)

    def _remove_orphan(self, path: str, name: str) -> None:
        """A temporary file of a writer (.HASH.PID.THREAD.tmp) whose process no longer runs; any other
        file is left alone."""
        match = _TMP_NAME.fullmatch(name)
        if match is None:
            return
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except PermissionError:  # a live process of another user
            return

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            if block_hash in self._index:
                return True
            if block_hash in self._unusable:
                return False
        if self.path_of(block_hash).is_file():  # written by a neighbour sharing the folder
            with self._lock:
                self._index[block_hash] = None
                self.stats.stored_blocks = len(self._index)
            return True
        return False

    def get(self, block_hash: BlockHash) -> memoryview | None:
        path = self.path_of(block_hash)
        data = bytearray(self.file_bytes + 1)  # one more: a longer file is seen
        try:
            with open(path, "rb", buffering=0) as file:
                size = file.readinto(data)
                while size < len(data):
                    more = file.readinto(memoryview(data)[size:])
                    if not more:
                        break
                    size += more
        except OSError:  # evicted meanwhile (by this server or a neighbour)
            self._forget(block_hash)
            return None
        try:
            payload = decode(memoryview(data)[:size], self.namespace, block_hash, self.block_bytes)
        except BlockFileError as error:
            self.stats.failures[error.fault] += 1
            logger.warning("KV block file %s is not used (%s); its blocks are recomputed", path, error)
            self._forget(block_hash)
            with self._lock:
                self._unusable.add(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        self.stats.hits += 1
        self.stats.read_bytes += size
        return payload

    def put(self, block_hash: BlockHash, payload: memoryview) -> None:
        if not self.writable or self.capacity_blocks < 1:
            return
        path = self.path_of(block_hash)
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        header = encode_header(self.namespace, block_hash, payload)
        self._evict_beyond(self.capacity_blocks - 1)
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temporary, "wb", buffering=0) as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, path)
        except OSError as error:
            self._stop_writing(error)
            try:
                temporary.unlink()
            except OSError:
                pass
            return
        with self._lock:
            self._unusable.discard(block_hash)
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
            self.stats.stored_blocks = len(self._index)
        self.stats.written_bytes += len(header) + len(payload)

    def _evict_beyond(self, keep: int) -> None:
        while True:
            with self._lock:
                if len(self._index) <= max(keep, 0):
                    self.stats.stored_blocks = len(self._index)
                    return
                block_hash, _ = self._index.popitem(last=False)
            try:
                self.path_of(block_hash).unlink()
            except FileNotFoundError:
                pass
            except OSError as error:
                self._stop_writing(error)
                return

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
            self.stats.stored_blocks = len(self._index)

    def _stop_writing(self, error: OSError) -> None:
        if self.write_error is None:
            self.write_error = f"{error.filename or self.folder}: {error.strerror or error}"
            self.stats.failures["write"] += 1
            logger.warning(
                "KV offload to %s stopped writing (%s); serving goes on, reading the blocks already there",
                self.folder,
                self.write_error,
            )
