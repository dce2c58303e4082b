"""The scheduler: which sequences compute how many tokens this step.

NOTE: there are no prefill and decode phases. Each step has one token budget
(`max_num_batched_tokens`). Decoding sequences (one known token left, plus any drafts) are served
first, then the running sequences still computing their prompt (oldest first), then waiting sequences
are admitted while the budget, `max_num_seqs` and free blocks allow. While anything decodes, the
prompt tokens of a step are also held to what its step-cost model allows (step_cost.py): a long prompt
is computed in chunks across steps, and a decoding stream never waits for a whole prompt. When a
running sequence needs a block and none is free, the last in the queue's order is preempted (the
newest; under the priority policy the one of the largest `priority`, then the newest): its blocks are
freed and it goes back to the waiting queue, to recompute its tokens (prompt and output) when
readmitted. Nothing is admitted in a step that preempted. A sequence with a LoRA adapter is admitted
once its adapter has a slot (runtime/lora.py); while every slot is held, the queue waits.

With a KV connector (kv_offload.py), a waiting sequence whose next full blocks are not in the pool but
in a lower tier takes pool blocks for them and waits off the queue while the connector fills them (a
loader thread; steps go on); then it is queued again at the front, and admitted on those blocks as
prefix-cache hits. The connector is asked once a sequence (a miss stays a miss, and hashing a long prompt
every step it waits would cost); preempted later, it recomputes what the pool lost.

Policies (vLLM's `--scheduling-policy`): `fcfs` admits in arrival order; `priority` in order of the
request's `priority` (smaller first, as vLLM), then arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kiln.runtime.block_pool import BlockHash, KVBlock
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.kv_offload import KVConnector
from kiln.runtime.lora import AdapterSlots
from kiln.runtime.sequence import Sequence, SequenceStatus
from kiln.runtime.step_cost import StepCostModel

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    enable_chunked_prefill: bool = True
    max_step_ms: float | None = None  # the step-time target while decoding; None: twice the decode step
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0, got {self.max_step_ms}")
        if self.policy not in SCHEDULING_POLICIES:
            known = ", ".join(SCHEDULING_POLICIES)
            raise ValueError(f"scheduling policy must be one of {known}, got {self.policy!r}")

    def check_priority(self, priority: int) -> None:
        """A ValueError for a request priority this policy would ignore (any but 0 under fcfs)."""
        if priority != 0 and self.policy != "priority":
            raise ValueError(
                "priority is only honoured under the priority scheduling policy; start the server with "
                "--scheduling-policy priority, or leave priority at 0"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq`, starting at token `start` (= tokens already computed)."""

    seq: Sequence
    start: int
    num_new_tokens: int
    # at most the sequence's last known token (and drafts), as the chunk was scheduled
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_decode", self.seq.num_tokens - self.start <= 1)

    @property
    def num_drafts(self) -> int:
        """Speculative draft tokens at the chunk's end (they follow the last known token)."""
        return max(0, self.start + self.num_new_tokens - self.seq.num_tokens)

    @property
    def completes_known_tokens(self) -> bool:
        """True when this chunk computes the sequence's last known token, so a new one is sampled."""
        return self.start + self.num_new_tokens >= self.seq.num_tokens


@dataclass
class _Loading:
    """A sequence whose blocks `first`, `first + 1`, ... a connector is filling with `hashes`."""

    seq: Sequence
    first: int
    hashes: list[BlockHash]
    aborted: bool = False


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def decode_rows(self) -> int:
        """Tokens of the decoding sequences' chunks (their last known token, and drafts)."""
        return sum(chunk.num_new_tokens for chunk in self.chunks if chunk.is_decode)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.decode_rows


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        adapters: AdapterSlots | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.adapters = adapters  # a running sequence holds its LoRA adapter's slot
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, _Loading] = {}  # by seq id: blocks being filled by the connector
        self._looked_up: set[str] = set()  # asked the connector once: not again
        self.num_preemptions = 0
        self.num_prefix_cache_hit_tokens = 0  # tokens of admitted sequences found in the prefix cache
        self.num_prefix_cache_queried_tokens = 0  # tokens of admitted sequences looked up there
        self.step_cost = StepCostModel(config.max_step_ms)

    def _order(self, seq: Sequence) -> tuple[int, ...]:
        """The queue's order: who is admitted first, and preempted last."""
        request = seq.request
        if self.config.policy == "priority":
            return (request.priority, request.arrival_index, seq.index)
        return (request.arrival_index, seq.index)

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq`: at the back (fcfs), at the front (`front`: preempted, or a held sample), or
        under the priority policy where its order puts it."""
        seq.status = SequenceStatus.WAITING
        if self.config.policy == "priority":
            key = self._order(seq)
            position = next((i for i, other in enumerate(self.waiting) if self._order(other) > key), None)
            self.waiting.insert(len(self.waiting) if position is None else position, seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks (a loading one's once its load ends:
        the loader is still writing them)."""
        self._looked_up.discard(seq.seq_id)
        loading = self.loading.get(seq.seq_id)
        if loading is not None:
            loading.aborted = True
            return
        if seq in self.running:
            self.running.remove(seq)
            self._release_adapter(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        self._collect_loads()
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens <= 1]
        prefilling = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        for seq in decoding:
            budget -= self._schedule_running(seq, budget, output)
        prefill_budget = budget
        allowed = self.step_cost.prefill_budget(output.decode_rows)
        if allowed is not None and self.config.enable_chunked_prefill:
            prefill_budget = min(budget, allowed)
        for seq in prefilling:
            prefill_budget -= self._schedule_running(seq, prefill_budget, output)
        if not output.preempted:
            self._admit_waiting(prefill_budget, output)
        return output

    def _schedule_running(self, seq: Sequence, budget: int, output: SchedulerOutput) -> int:
        """Add a chunk of running `seq` within `budget` tokens (preempting for its blocks if need be);
        the tokens it takes."""
        if budget <= 0 or seq not in self.running:  # out of budget, or preempted earlier this step
            return 0
        wanted = seq.num_tokens + len(seq.draft_token_ids) - seq.num_computed_tokens
        num_new = min(wanted, budget)
        if seq.draft_token_ids and not self.kv.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
            seq.draft_token_ids = []  # drafts never cost another sequence its blocks
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        num_new = _whole_images(seq, seq.num_computed_tokens, num_new)
        if not self._allocate_or_preempt(seq, seq.num_computed_tokens + num_new, output):
            return 0
        output.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
        return num_new

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        while not self.kv.allocate(seq.seq_id, num_tokens):
            victim = max(self.running, key=self._order)
            self._preempt(victim)
            output.preempted.append(victim)
            output.chunks = [chunk for chunk in output.chunks if chunk.seq is not victim]
            if victim is seq:
                return False
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if self.adapters is not None and seq.request.lora_name is not None:
            self.adapters.release(seq.request.lora_name)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_adapter(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq, front=True)

    def _admit_waiting(self, budget: int, output: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq.cache_key_ids, seq.request.cache_salt)
            cached = cached[: self._max_cached_blocks(seq)]
            if self._start_load(seq, cached):
                continue
            num_computed = len(cached) * self.kv.block_size
            remaining = seq.num_tokens - num_computed
            # Without chunked prefill a sequence is admitted whole, except one preempted after it grew past
            # max_num_batched_tokens (the engine refuses longer prompts): it could never be admitted whole.
            whole_fits = remaining <= self.config.max_num_batched_tokens
            if not self.config.enable_chunked_prefill and remaining > budget and whole_fits:
                break
            num_new = _whole_images(seq, num_computed, min(remaining, budget))
            adapter = seq.request.lora_name
            if adapter is not None and self.adapters is not None and self.adapters.acquire(adapter) is None:
                break  # every adapter slot is held by running sequences of other adapters
            if not self.kv.allocate(seq.seq_id, num_computed + num_new, cached):
                self._release_adapter(seq)
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0 and not seq.output_token_ids:
                seq.num_cached_tokens = num_computed
            self.num_prefix_cache_hit_tokens += num_computed
            self.num_prefix_cache_queried_tokens += seq.num_tokens
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.chunks.append(ScheduledChunk(seq, num_computed, num_new))
            budget -= num_new

    def _max_cached_blocks(self, seq: Sequence) -> int:
        """The most full blocks `seq` may take computed: one token is left to compute, and no position
        whose prompt logprob (or, for mean pooling, hidden state) is still missing is skipped."""
        limit = (seq.num_tokens - 1) // self.kv.block_size
        pooled = seq.request.pooled
        if pooled is not None and pooled.params.needs_every_row:
            return 0
        collected = seq.request.prompt_logprobs
        if collected is not None and seq.index == 0:
            limit = min(limit, (len(collected) - 1) // self.kv.block_size)
        return limit

    def _start_load(self, seq: Sequence, cached: list[KVBlock]) -> bool:
        """Have the connector fill the blocks after the pool's `cached` hits that it holds; True where
        `seq` left the queue to wait for them."""
        if self.connector is None or seq.seq_id in self._looked_up or not self.kv.pool.enable_caching:
            return False
        limit = self._max_cached_blocks(seq)
        first = len(cached)
        if first >= limit:
            return False
        hashes = self.kv.prefix_hashes(seq.cache_key_ids, limit, seq.request.cache_salt)[first:]
        count = self.connector.available(hashes)
        if count == 0:
            self._looked_up.add(seq.seq_id)
            return False
        if not self.kv.allocate(seq.seq_id, (first + count) * self.kv.block_size, cached):
            return False  # asked again once blocks are free
        self.waiting.popleft()
        self._looked_up.add(seq.seq_id)
        block_ids = self.kv.block_table(seq.seq_id)[first : first + count]
        self.loading[seq.seq_id] = _Loading(seq, first, hashes[:count])
        self.connector.start_load(seq.seq_id, hashes[:count], block_ids)
        return True

    def _collect_loads(self) -> None:
        """Sequences whose loads ended: their filled blocks cached, theirs freed, queued again first."""
        if self.connector is None or not self.loading:
            return
        for seq_id, num_loaded in self.connector.finished_loads().items():
            loading = self.loading.pop(seq_id, None)
            if loading is None:
                continue
            if not loading.aborted:
                self.kv.register_loaded(seq_id, loading.first, loading.hashes[:num_loaded])
            self.kv.free(seq_id)
            if not loading.aborted:
                self.add(loading.seq, front=True)

    def drain_loads(self) -> None:
        """Wait for every load in flight (before the KV cache goes away or changes meaning)."""
        while self.loading and self.connector is not None:
            self.connector.wait_for_load(0.1)
            self._collect_loads()


def _whole_images(seq: Sequence, start: int, num_new: int) -> int:
    """`num_new` tokens from `start`, moved so that the chunk holds whole any image it touches whose
    tokens attend both ways (Gemma 3's)."""
    images = seq.request.images
    if images is None or not images.whole_spans:
        return num_new
    return images.chunk_end(start, start + num_new) - start
