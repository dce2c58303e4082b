"""The offload tiers on their own: the block file's checks, the disk tier's LRU bound, its restart and
neighbour behaviour and leftovers of dead writers, the host-RAM tier, and blocks in and out of a KV cache
(numpy on the host, torch as on a GPU) in every cache dtype."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.runtime.kv_block_file import HEADER_BYTES, BlockFileError, decode, encode_header
from kiln.runtime.kv_offload import TieredKVOffload, read_block, write_block
from kiln.runtime.kv_tiers import SUFFIX, DiskTier, HostTier

NAMESPACE = bytes(range(32))
BLOCK_BYTES = 64


def _hash(index: int) -> bytes:
    return index.to_bytes(32, "big")


def _payload(index: int) -> memoryview:
    return memoryview(bytes((index + i) % 256 for i in range(BLOCK_BYTES)))


def _file(payload: memoryview, namespace: bytes = NAMESPACE, block_hash: bytes = _hash(1)) -> memoryview:
    return memoryview(encode_header(namespace, block_hash, payload) + bytes(payload))


def _fault(data: bytes | memoryview) -> str:
    with pytest.raises(BlockFileError) as error:
        decode(memoryview(bytes(data)), NAMESPACE, _hash(1), BLOCK_BYTES)
    return error.value.fault


def test_a_block_file_names_its_namespace_block_and_checksum() -> None:
    good = _file(_payload(1))
    assert bytes(decode(good, NAMESPACE, _hash(1), BLOCK_BYTES)) == bytes(_payload(1))
    assert _fault(b"NOTKILN!" + bytes(good[8:])) == "foreign"
    assert _fault(_file(_payload(1), namespace=bytes(32))) == "foreign"
    assert _fault(_file(_payload(1), block_hash=_hash(2))) == "foreign"
    assert _fault(good[: HEADER_BYTES - 1]) == "truncated"
    assert _fault(good[:-1]) == "truncated"
    assert _fault(bytes(good) + b"x") == "corrupt"
    flipped = bytearray(good)
    flipped[HEADER_BYTES + 5] ^= 0x10
    assert _fault(flipped) == "corrupt"


def _tier(folder: Path, blocks: int) -> DiskTier:
    return DiskTier(folder, NAMESPACE, BLOCK_BYTES, blocks * (HEADER_BYTES + BLOCK_BYTES))


def test_the_disk_tier_keeps_its_size_dropping_the_least_recently_used(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 3)
    for index in range(3):
        tier.put(_hash(index), _payload(index))
    assert tier.get(_hash(0)) is not None  # used: now the most recent
    tier.put(_hash(3), _payload(3))
    assert not tier.path_of(_hash(1)).exists() and tier.path_of(_hash(0)).exists()
    assert len(list(tmp_path.rglob(f"*{SUFFIX}"))) == 3 == tier.stats.stored_blocks
    assert tier.stats.hits == 1 and tier.stats.written_bytes == 4 * (HEADER_BYTES + BLOCK_BYTES)
    time.sleep(0.01)
    assert tier.get(_hash(2)) is not None  # its file's time is now the newest
    restarted = _tier(tmp_path, 2)  # a restart with less room drops the oldest (block 0, then 3)
    assert [restarted.contains(_hash(i)) for i in range(4)] == [False, False, True, True]
    assert bytes(restarted.get(_hash(2)) or b"") == bytes(_payload(2))


def test_neighbours_sharing_a_folder_read_each_others_blocks_and_never_tear_one(tmp_path: Path) -> None:
    first, second = _tier(tmp_path, 100), _tier(tmp_path, 100)
    first.put(_hash(7), _payload(7))
    assert second.contains(_hash(7)) and bytes(second.get(_hash(7)) or b"") == bytes(_payload(7))

    def write(tier: DiskTier) -> None:
        for _ in range(50):
            tier.put(_hash(8), _payload(8))

    threads = [threading.Thread(target=write, args=(tier,)) for tier in (first, second)]
    for thread in threads:
        thread.start()
    for _ in range(200):  # a reader meanwhile sees the whole block or no file, never a part
        payload = second.get(_hash(8))
        assert payload is None or bytes(payload) == bytes(_payload(8))
    for thread in threads:
        thread.join()
    assert not second.stats.failures and not first.stats.failures
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_dead_writers_temporary_file_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 10)
    tier.put(_hash(1), _payload(1))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = tier.path_of(_hash(2)).with_name(f".{_hash(2).hex()}.{int(gone.stdout)}.1.tmp")
    live = tier.path_of(_hash(3)).with_name(f".{_hash(3).hex()}.{os.getpid()}.1.tmp")
    someone_elses = dead.with_name(f"notes.{int(gone.stdout)}.1.tmp")
    for path in (dead, live, someone_elses):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half a block")
    restarted = _tier(tmp_path, 10)
    assert not dead.exists() and live.exists() and someone_elses.exists()
    assert restarted.contains(_hash(1)) and not restarted.contains(_hash(2))


def test_the_host_tier_holds_its_size_in_blocks() -> None:
    tier = HostTier(2 * BLOCK_BYTES, BLOCK_BYTES)
    for index in range(3):
        tier.put(_hash(index), _payload(index))
    assert [tier.contains(_hash(i)) for i in range(3)] == [False, True, True]
    assert bytes(tier.get(_hash(2)) or b"") == bytes(_payload(2)) and tier.stats.hits == 1


def test_a_block_loaded_from_disk_stays_in_the_host_tier_and_saves_past_the_backlog_are_dropped(
    tmp_path: Path,
) -> None:
    cache = np.arange(2 * 2 * 4 * 2 * 1 * 2, dtype=np.float32).reshape(2, 2, 4, 2, 1, 2)  # 4 blocks of 2
    block_bytes = cache[:, :, 0].nbytes
    disk = DiskTier(tmp_path, NAMESPACE, block_bytes, 10 * (HEADER_BYTES + block_bytes))
    host = HostTier(10 * block_bytes, block_bytes)
    offload = TieredKVOffload([host, disk], max_pending_bytes=block_bytes)
    offload.bind(cache)
    offload.save([(1, _hash(1))])
    offload.flush()
    assert host.contains(_hash(1)) and disk.contains(_hash(1))
    offload.close()
    host = HostTier(10 * block_bytes, block_bytes)  # a restart: the host tier is empty again
    offload = TieredKVOffload([host, DiskTier(tmp_path, NAMESPACE, block_bytes, 2**20)], max_pending_bytes=0)
    offload.bind(cache)
    assert offload.available([_hash(1), _hash(2)]) == 1
    offload.start_load("r", [_hash(1)], [3])
    deadline = time.monotonic() + 30
    while not (done := offload.finished_loads()):
        assert time.monotonic() < deadline, "the load did not finish"
        offload.wait_for_load(1)
    assert done == {"r": 1}
    assert np.array_equal(cache[:, :, 3], cache[:, :, 1]) and host.contains(_hash(1))
    offload.save([(2, _hash(2))])  # nothing may wait for the disk: no room in the backlog
    offload.flush()
    stats = offload.stats()
    assert stats.tiers["disk"].failures == {"dropped": 1} and stats.tiers["cpu"].stored_blocks == 2
    offload.close()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f8e4m3"])
def test_blocks_go_in_and_out_of_numpy_and_torch_caches_bit_for_bit(dtype: str) -> None:
    host_dtype = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}.get(
        dtype, ml_dtypes.float8_e4m3fn
    )
    values = np.random.default_rng(0).normal(size=(3, 2, 5, 4, 2, 8)).astype(np.float32)
    host = values.astype(host_dtype)
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}.get(
        dtype, torch.float8_e4m3fn
    )
    device = torch.from_numpy(values).to(torch_dtype)
    for cache in (host, device):
        payload = read_block(cache, 1)
        assert payload.nbytes == host[:, :, 1].nbytes
        write_block(cache, 4, memoryview(payload))
    assert host[:, :, 4].tobytes() == host[:, :, 1].tobytes()
    assert torch.equal(device[:, :, 4].view(torch.uint8), device[:, :, 1].view(torch.uint8))
    assert read_block(device, 1).tobytes() == read_block(host, 1).tobytes()  # the same bytes either way
