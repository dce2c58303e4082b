"""The KV cache's size comes from what the limits need, capped by the memory available where it lives
(the host's, or a GPU's free memory); its host memory is committed only as blocks are written, and the
block pool reuses freed blocks before fresh ones."""

from __future__ import annotations

import pytest

from kiln.backends.base import Executable, KVCacheSpec
from kiln.ir.step import KV_CACHE_INPUT, StepSignature, kv_cache_type
from kiln.runtime.block_pool import BlockPool
from kiln.runtime.config import EngineConfig, available_memory_bytes, plan_kv_cache
from kiln.runtime.scheduler import SchedulerConfig

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype="f32")  # SmolLM2-135M
PER_BLOCK = SPEC.bytes_per_block(16)


def test_the_default_holds_max_num_seqs_full_length_sequences() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4))
    plan = plan_kv_cache(config, [SPEC], max_model_len=1000)
    assert plan.num_blocks == 4 * 63 + 1  # ceil(1000 / 16) blocks a sequence, and the null block
    assert plan.num_tokens == 4 * 63 * 16 and plan.bytes == plan.num_blocks * PER_BLOCK
    assert "4 sequences of 1,000 tokens" in plan.describe()


def test_the_default_is_capped_by_available_memory() -> None:
    config = EngineConfig(kv_cache_fraction=0.01, scheduler=SchedulerConfig(max_num_seqs=1024))
    plan = plan_kv_cache(config, [SPEC], max_model_len=131072)
    assert plan.bytes <= available_memory_bytes() * 0.01 * 1.01
    assert "capped at 1% of the" in plan.describe()


def test_a_gpu_cache_is_sized_from_the_devices_free_memory() -> None:
    """The figure `torch.cuda.mem_get_info` gives after the weights are loaded, here given as a number."""
    free = 10 * 2**30
    many = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1024))
    capped = plan_kv_cache(many, [SPEC], 131072, device="cuda:0", available=free)
    assert capped.num_blocks == int(free * 0.9) // PER_BLOCK
    assert "capped at 90% of the 10.0 GiB free on cuda:0" in capped.describe()
    few = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2))
    assert plan_kv_cache(few, [SPEC], 1000, device="cuda:0", available=free).num_blocks == 2 * 63 + 1
    asked = EngineConfig(kv_cache_fraction=0.25, scheduler=SchedulerConfig(max_num_seqs=1024))
    assert plan_kv_cache(asked, [SPEC], 131072, "cuda", free).num_blocks == int(free * 0.25) // PER_BLOCK
    with pytest.raises(ValueError, match="bytes of memory are free on cuda"):
        plan_kv_cache(many, [SPEC], 131072, device="cuda", available=PER_BLOCK)
    host = plan_kv_cache(many, [SPEC], 131072, device="cpu", available=free)
    assert host.num_blocks == int(free * 0.5) // PER_BLOCK  # half of the host's


def test_the_cache_goes_where_the_executable_reads_it() -> None:
    class OnTheHost(Executable):
        signature = StepSignature(((KV_CACHE_INPUT, kv_cache_type(2, 2, 8)),))

    class OnTheGpu(OnTheHost):
        kv_cache_device = "cuda"

    assert OnTheGpu().kv_cache_device == "cuda" and OnTheHost().kv_cache_device == "cpu"
    assert OnTheHost().kv_cache_spec == KVCacheSpec(2, 2, 8, "f32")


def test_explicit_sizes_win() -> None:
    assert plan_kv_cache(EngineConfig(num_blocks=7), [SPEC], 8192).num_blocks == 7
    by_bytes = plan_kv_cache(EngineConfig(kv_cache_memory=10 * PER_BLOCK + 5), [SPEC], 8192)
    assert by_bytes.num_blocks == 10 and "kv_cache_memory" in by_bytes.describe()
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        plan_kv_cache(EngineConfig(kv_cache_memory=PER_BLOCK), [SPEC], 8192)


def _resident_anon_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


def test_a_host_cache_costs_memory_only_where_written() -> None:
    before = _resident_anon_kib()
    cache = SPEC.allocate(8193, 16)  # 5.6 GiB reserved
    assert cache.shape == (30, 2, 8193, 16, 3, 64) and cache.flags.c_contiguous
    assert cache.ctypes.data % 64 == 0  # the TVM kernels' aligned loads
    assert float(abs(cache[:, :, 4096]).sum()) == 0.0
    cache[:, :, 1:3] = 1.0  # two blocks in every layer: 1.4 MiB
    assert _resident_anon_kib() - before < 64 * 1024


def test_freed_blocks_are_reused_before_fresh_ones_and_cached_ones_last() -> None:
    pool = BlockPool(10)
    first = pool.allocate(3)
    pool.register(first[0], b"prefix")
    pool.free(reversed(first))
    again = pool.allocate(2)
    assert {b.block_id for b in again} == {first[1].block_id, first[2].block_id}  # no hash: reused first
    assert pool.lookup(b"prefix") is first[0]
    (evicted,) = pool.allocate(1)
    assert evicted is first[0] and pool.lookup(b"prefix") is None  # then the cached one, then fresh
    assert {b.block_id for b in pool.allocate(2)} == {4, 5}
