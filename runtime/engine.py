"""LLMEngine: add requests, step, abort. One step = schedule → run the executable's step → sample →
update (stops, detokenization, outputs). With speculative decoding (speculative/), drafts are proposed
before scheduling and the speculating sequences' rows are verified instead of sampled."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from kiln.backends.base import Executable, KVCache, Logits
from kiln.ir.step import (
    IMAGE_ROWS_INPUT,
    LORA_SLOTS_INPUT,
    VISIBLE_ENDS_INPUT,
    SequenceSlice,
    StepInputs,
    build_step_inputs,
    image_spans,
)
from kiln.runtime.block_pool import KVBlock, model_root_hash
from kiln.runtime.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, plan_kv_cache
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.kv_offload import KVConnector, OffloadStats, open_offload
from kiln.runtime.lora import AdapterReader, AdapterSlots, LoRAConfig, LoRAError, LoRARequest
from kiln.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kiln.runtime.pooling import EMBEDDING_PARAMS, PooledRows, PoolingParams
from kiln.runtime.runner import ModelRunner
from kiln.runtime.sampler import SequenceSampling, make_generator, prompt_logprobs, sample
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledChunk, Scheduler
from kiln.runtime.sequence import PromptImages, Request, Sequence, SequenceStatus
from kiln.runtime.speculative.decoder import SpeculativeDecoder, SpeculativeStats
from kiln.runtime.speculative.proposer import make_proposer
from kiln.runtime.structured_output import Constraint, Grammars
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.vision import ImageEmbedding, VisionModel, cache_key_ids, place_images


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests
    num_generation_tokens: int = 0  # tokens sampled
    num_computed_tokens: int = 0  # tokens run through the step (prefix-cache hits are not)
    num_steps: int = 0
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)


@dataclass
class _SequenceState:
    sampling: SequenceSampling
    detokenizer: IncrementalDetokenizer
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    constraint: Constraint | None = None  # the structured output's matcher


_NO_ROWS: Logits = np.empty((0, 0), np.float32)  # a step whose batch holds only embedding requests


class LLMEngine:
    def __init__(
        self,
        executable: Executable,
        tokenizer: Tokenizer,
        model_id: str,
        max_model_len: int,
        config: EngineConfig | None = None,
        vocab_size: int | None = None,
        draft: Executable | None = None,
        vision: VisionModel | None = None,
        lora: LoRAConfig | None = None,
        adapter_reader: AdapterReader | None = None,
    ) -> None:
        """`vocab_size`: the LM head's rows (the logits' width), if more than the tokenizer's. `draft`: the
        draft model of speculative method draft_model (same vocabulary). `vision`: a vision-language
        model's image encoder (prompts may then hold images). `lora`: serve LoRA adapters (read by
        `adapter_reader`) on an executable compiled with them."""
        self.config = config or EngineConfig()
        spec = self.config.speculative
        if (spec is not None and spec.method == "draft_model") != (draft is not None):
            raise ValueError("a draft executable goes with speculative method draft_model, and only with it")
        self.tokenizer = tokenizer
        self.vision = vision
        self.image_row_base = vocab_size or tokenizer.vocab_size  # token id base + e: image row e
        self.max_model_len = min(self.config.max_model_len or DEFAULT_MAX_MODEL_LEN, max_model_len)
        self.block_size = self.config.block_size
        specs = [executable.kv_cache_spec] + ([draft.kv_cache_spec] if draft is not None else [])
        cache_device = executable.kv_cache_device
        self.kv_cache_plan = plan_kv_cache(self.config, specs, self.max_model_len, cache_device)
        self.num_blocks = self.kv_cache_plan.num_blocks
        self.runner = ModelRunner(executable, self.num_blocks, self.block_size)
        self.stats = EngineStats()
        self.spec_decoder = (
            SpeculativeDecoder(
                spec,
                make_proposer(spec, draft, self.num_blocks, self.block_size, tokenizer.vocab_size),
                self.max_model_len,
                self.stats.speculative,
            )
            if spec is not None
            else None
        )
        self.kv = KVCacheManager(
            self.num_blocks, self.block_size, model_id, self.config.enable_prefix_caching
        )
        self.offload = self._open_offload(draft)
        self.model_id = model_id
        self.weight_version = 0  # bumped by every change of weights (replace_executable)
        self._weights_tag = ""  # in the prefix chain's root: "" for the artifact's weights
        self.adapters = self._adapter_slots(lora, adapter_reader)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.adapters, self.offload)
        self.requests: dict[str, Request] = {}
        self._states: dict[str, _SequenceState] = {}
        self._held: dict[str, list[Sequence]] = {}  # n > 1: samples that wait for the prompt's blocks
        self._arrivals = itertools.count()
        self.grammars = Grammars(tokenizer, max(vocab_size or 0, tokenizer.vocab_size))

    @property
    def executable(self) -> Executable:
        return self.runner.executable

    @property
    def kv_cache(self) -> KVCache | None:
        return self.runner.kv_cache

    @property
    def asleep(self) -> int:
        return self.runner.asleep

    def _adapter_slots(self, lora: LoRAConfig | None, reader: AdapterReader | None) -> AdapterSlots | None:
        spec = self.runner.lora_spec
        if lora is None:
            return None
        if spec is None:
            raise LoRAError(
                "this model's step takes no LoRA adapters: it was compiled without --enable-lora",
                hint="compile (or serve) the model with --enable-lora",
            )
        if reader is None:
            raise ValueError("serving LoRA adapters needs an adapter reader")
        tables = self.runner.allocate_lora_tables(spec, lora.max_loras, lora.max_lora_rank)
        return AdapterSlots(spec, lora, tables, reader)

    def _open_offload(self, draft: Executable | None) -> KVConnector | None:
        config = self.config.kv_offload
        if config is None:
            return None
        if not self.config.enable_prefix_caching:
            raise ValueError("KV offload keeps prefix-cache blocks: it needs prefix caching enabled")
        if draft is not None:
            raise ValueError(
                "KV offload does not keep a draft model's KV cache: use it without --speculative-config's "
                "draft model (n-gram speculation works with it)"
            )
        offload = open_offload(config, self.executable.kv_cache_spec, self.block_size)
        offload.bind(self.kv_cache)
        self.kv.pool.on_evict = self._write_back_evicted
        return offload

    def _write_back_evicted(self, block: KVBlock) -> None:
        """A cached block the pool is about to reuse: to the offload tiers first (its K/V still there)."""
        if self.offload is not None and block.block_hash is not None:
            self.offload.save([(block.block_id, block.block_hash)])

    def offload_stats(self) -> OffloadStats | None:
        return self.offload.stats() if self.offload is not None else None

    def close(self) -> None:
        """Hand the pool's cached blocks to the offload tiers, finish writing them, stop their threads."""
        if self.offload is not None:
            self.scheduler.drain_loads()
            self._write_back()
            self.offload.close()

    def _write_back(self) -> None:
        """The pool's cached blocks to the offload tiers (those they hold already are skipped)."""
        if self.offload is not None and self.kv_cache is not None:
            cached = self.kv.pool.cached_blocks()
            self.offload.save([(block.block_id, block.block_hash) for block in cached if block.block_hash])

    # -- adapters ---------------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Register an adapter (read and checked now; copied into a slot when a request uses it)."""
        self.lora_slots().register(request)

    def remove_lora(self, name: str) -> None:
        """Forget an adapter; a LoRAError while requests use it (they are named by count)."""
        adapters = self.lora_slots()
        waiting = sum(1 for seq in self.scheduler.waiting if seq.request.lora_name == name) + sum(
            len(held)
            for request_id, held in self._held.items()
            if self.requests[request_id].lora_name == name
        )
        adapters.unregister(name, waiting)

    def lora_slots(self) -> AdapterSlots:
        if self.adapters is None:
            raise LoRAError(
                "this server serves no LoRA adapters",
                hint="start it with --enable-lora (kiln.LLM(enable_lora=True))",
            )
        return self.adapters

    # -- weights and sleep (runtime/live_weights.py) ----------------------------------------------------

    def replace_executable(self, executable: Executable, version: int) -> Executable:
        """Serve `executable` (the same compiled code with other weights) from the next step; the old one
        is returned. Only while no request is in flight, so no sequence holds K/V of two weights; every
        cached prefix is forgotten (its K/V came from the old weights)."""
        self._refuse_with_requests("replace the weights")
        old = self.runner.replace_executable(executable)
        self.weight_version = version
        self._weights_tag = f"#weights{version}:{secrets.token_hex(8)}"
        self._forget_prefixes()
        return old

    def sleep(self, level: int) -> Executable | None:
        """Level 1 frees the KV cache; level 2 the weights too (returned: the caller lets them go).
        Only while no request is in flight."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._refuse_with_requests("sleep")
        self._unbind_offload()
        self._forget_prefixes()
        return self.runner.sleep(level)

    def wake_up(self) -> None:
        """A zeroed KV cache again; after level 2 the weights must have been replaced first."""
        if self.runner.wake_up() and self.offload is not None:
            self.offload.bind(self.kv_cache)

    @property
    def weights_dropped(self) -> bool:
        return self.runner.weights_dropped

    def _refuse_with_requests(self, what: str) -> None:
        if self.requests:
            raise RuntimeError(f"cannot {what} with {len(self.requests)} requests in flight")

    def _unbind_offload(self) -> None:
        if self.offload is not None:
            self.scheduler.drain_loads()
            self._write_back()
            self.offload.flush()
            self.offload.bind(None)

    def _forget_prefixes(self) -> None:
        """Forget the pool's cached blocks; new ones chain from a root naming the weights: after an update,
        this process's own update, so that no other process (sharing an offload folder) mistakes them for
        its version n."""
        self.scheduler.drain_loads()
        self.kv.pool.reset_prefix_cache()
        self.kv.root_hash = model_root_hash(self.model_id + self._weights_tag)

    def abort_all(self) -> list[RequestOutput]:
        """Stop every request now; the final output of each (finish_reason "abort")."""
        finals = []
        for request in list(self.requests.values()):
            self._end_aborted(request)
            finals.append(self._output(request))
        return finals

    def _end_aborted(self, request: Request) -> None:
        """Mark the request's unfinished sequences aborted and take them out of the schedule."""
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
        self._held.pop(request.request_id, None)

    # -- requests ---------------------------------------------------------------------------------

    def validate(self, prompt: str | Seq[int], params: SamplingParams) -> tuple[list[int], int]:
        """The prompt's token ids and its max_tokens, or a ValueError saying what does not fit."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, which leaves no room in the model's context of "
                f"{self.max_model_len} tokens (max_model_len); shorten the prompt"
            )
        scheduler = self.scheduler.config
        # Without chunked prefill a prompt is computed in one step. The whole prompt is counted even
        # where a cached prefix would shorten that step: the cache may have evicted it by then.
        if not scheduler.enable_chunked_prefill and len(token_ids) > scheduler.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than the {scheduler.max_num_batched_tokens} "
                f"tokens one step computes (max_num_batched_tokens), and chunked prefill is disabled; "
                f"raise max_num_batched_tokens to at least {len(token_ids)}, enable chunked prefill, or "
                f"shorten the prompt"
            )
        capacity = self.kv.pool.num_usable * self.block_size
        # no max_tokens: up to the end of the context, or of the KV cache where that is smaller
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else min(room, capacity - len(token_ids))
        )
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); lower max_tokens to at most {room}"
            )
        if max_tokens < 1 or len(token_ids) + max_tokens > capacity:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the KV cache's "
                f"{capacity} tokens; lower max_tokens or give the cache more memory"
            )
        return token_ids, max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        images: Seq[ImageEmbedding] = (),
        lora_request: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """Queue a request; `priority` orders it under the priority scheduling policy (smaller first)
        and must stay 0 under fcfs. `images`: a vision-language model's, in prompt order (`place_images`
        says where their rows go). `lora_request`: its adapter (registered now where it is new).
        `pooling`: an embedding request: the prompt runs through the executable's `embed` and its output
        carries the pooled vector, no tokens (`params` is then ignored)."""
        if pooling is not None:
            width = self.check_embeds()
            if pooling.dimensions is not None and pooling.dimensions > width:
                raise ValueError(
                    f"dimensions must be <= the model's hidden size {width}, got {pooling.dimensions}"
                )
            params = EMBEDDING_PARAMS
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.config.check_priority(priority)
        prompt_images = None
        if images:
            prompt, prompt_images = self.place_images(prompt, images)
        token_ids, max_tokens = self.validate(prompt, params)
        adapter = self.lora_slots().register(lora_request) if lora_request is not None else None
        constraint = params.structured_output
        grammar = self.grammars.compile(constraint) if constraint is not None else None
        request = Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            token_ids,
            params,
            max_tokens,
            next(self._arrivals),
            priority,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            images=prompt_images,
            lora_name=adapter.request.lora_name if adapter is not None else None,
            cache_salt=adapter.cache_salt if adapter is not None else None,
            pooled=PooledRows(pooling) if pooling is not None else None,
        )
        if self.adapters is not None:
            self.adapters.requests_by_adapter[request.lora_name or ""] += 1
        for index in range(params.n):
            seq = Sequence(f"{request_id}#{index}", index, request, list(token_ids))
            request.sequences.append(seq)
            seed = None if params.seed is None else params.seed + index
            self._states[seq.seq_id] = _SequenceState(
                SequenceSampling(params, make_generator(seed), token_ids, seq.output_token_ids),
                IncrementalDetokenizer(
                    self.tokenizer,
                    token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                ),
                [],
                [],
                self.grammars.constraint(grammar, params.reasoning, token_ids)
                if grammar is not None
                else None,
            )
        self.requests[request_id] = request
        self.stats.num_prompt_tokens += len(token_ids)
        self.scheduler.add(request.sequences[0])
        self._held[request_id] = request.sequences[1:]

    def check_embeds(self) -> int:
        """The width of the model's embeddings; a ValueError where the served executable has no `embed`
        entry point."""
        if not self.executable.embeds:
            raise ValueError(
                "this model cannot embed: its artifact has no `embed` function (the ONNX Runtime and "
                "TensorRT backends, tensor parallelism, and artifacts compiled before kiln had one lack it)"
            )
        return self.executable.embedding_size

    def place_images(
        self, prompt: str | Seq[int], images: Seq[ImageEmbedding]
    ) -> tuple[list[int], PromptImages]:
        """The prompt's ids with each image's placeholder expanded to its rows' tokens, and where those
        rows go; a ValueError for a text-only model or placeholders that do not match the images."""
        if self.vision is None:
            raise ValueError("this model takes text only: a prompt may not hold images")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        placeholders = [image.placeholder for image in images]
        spec = self.vision.spec
        expanded, positions = place_images(token_ids, placeholders, spec.image_token_id, spec.placeholder_id)
        rows = np.concatenate([image.rows for image in images]).astype(np.float32, copy=False)
        keys = cache_key_ids(expanded, positions, images)
        return expanded, PromptImages(
            rows, positions, keys, image_spans(positions) if spec.bidirectional else ()
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not (or no longer) here."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._end_aborted(request)
        for seq in request.sequences:
            self._states.pop(seq.seq_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def input_modalities(self) -> tuple[str, ...]:
        """What a prompt may hold."""
        return ("text", "image") if self.vision is not None else ("text",)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        held = sum(len(held) for held in self._held.values())
        return len(self.scheduler.waiting) + len(self.scheduler.loading) + held

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            if self.scheduler.loading and self.offload is not None:
                self.offload.wait_for_load(0.05)  # nothing else to do until a load ends
            return []
        if self.spec_decoder is not None:
            self.spec_decoder.scheduled(scheduled.chunks, self.kv.block_table, self.scheduler.running)
        self.stats.num_steps += 1
        pooling = [chunk for chunk in scheduled.chunks if chunk.seq.request.pooled is not None]
        generating = [chunk for chunk in scheduled.chunks if chunk.seq.request.pooled is None]
        started = time.perf_counter()
        touched: dict[str, Request] = {}
        if pooling:
            self._pool(pooling, touched)
        slices = [self._slice(chunk) for chunk in generating]
        logits = self.runner.step(self._step_inputs(slices)) if generating else _NO_ROWS
        self.scheduler.step_cost.observe(
            scheduled.decode_rows, scheduled.num_prefill_tokens, time.perf_counter() - started
        )
        to_sample: list[tuple[Sequence, int]] = []
        to_verify: list[tuple[Sequence, int, int]] = []
        row = 0
        for chunk, piece in zip(generating, slices, strict=True):
            seq = chunk.seq
            num_drafts = chunk.num_drafts
            sampled_rows = 1 + num_drafts if chunk.completes_known_tokens else 0
            num_prompt_rows = len(piece.logits_at) - sampled_rows
            if num_prompt_rows:
                self._add_prompt_logprobs(seq.request, chunk, logits[row : row + num_prompt_rows])
                touched[seq.request.request_id] = seq.request
            row += num_prompt_rows
            seq.num_computed_tokens += chunk.num_new_tokens - num_drafts  # drafts count once accepted
            self.stats.num_computed_tokens += chunk.num_new_tokens
            self._cache_full_blocks(seq, write_through=not chunk.is_decode)
            if num_drafts:
                to_verify.append((seq, row, num_drafts))
            elif chunk.completes_known_tokens:
                to_sample.append((seq, row))
            row += sampled_rows
        if to_sample:
            self._sample_and_update(logits, to_sample, touched)
        for seq, first_row, num_drafts in to_verify:
            self._verify(seq, logits[first_row : first_row + num_drafts + 1], num_drafts, touched)
        if self.spec_decoder is not None:
            self.spec_decoder.end_step(scheduled.chunks)
        return [self._output(request) for request in touched.values()]

    def _step_inputs(self, slices: list[SequenceSlice]) -> StepInputs:
        signature = self.runner.signature
        return build_step_inputs(
            slices,
            self.block_size,
            self.image_row_base if signature.takes(IMAGE_ROWS_INPUT) else None,
            signature.takes(VISIBLE_ENDS_INPUT),
            signature.takes(LORA_SLOTS_INPUT) and self.adapters is not None,
        )

    def _pool(self, chunks: list[ScheduledChunk], touched: dict[str, Request]) -> None:
        """Embedding requests' prompt chunks through `embed`; a request whose prompt has run ends with
        its pooled vector."""
        slices = [self._slice(chunk, self._pooled_rows(chunk)) for chunk in chunks]
        hidden = self.runner.embed(self._step_inputs(slices))
        row = 0
        for chunk, piece in zip(chunks, slices, strict=True):
            seq, pooled = chunk.seq, chunk.seq.request.pooled
            assert pooled is not None
            pooled.add(chunk.start, hidden[row : row + len(piece.logits_at)])
            row += len(piece.logits_at)
            seq.num_computed_tokens += chunk.num_new_tokens
            self.stats.num_computed_tokens += chunk.num_new_tokens
            self._cache_full_blocks(seq, write_through=True)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.request.embedding = pooled.result()
            seq.finish_reason, seq.status = "stop", SequenceStatus.FINISHED
            self._states[seq.seq_id].detokenizer.finish()
            self.scheduler.remove(seq)
            touched[seq.request.request_id] = seq.request

    @staticmethod
    def _pooled_rows(chunk: ScheduledChunk) -> list[int]:
        """The chunk's rows whose hidden states its request's pooling reads."""
        pooled = chunk.seq.request.pooled
        assert pooled is not None
        if pooled.params.needs_every_row:
            return list(range(chunk.num_new_tokens))
        return [chunk.num_new_tokens - 1] if chunk.completes_known_tokens else []

    def _slice(self, chunk: ScheduledChunk, rows: list[int] | None = None) -> SequenceSlice:
        """`rows`: the chunk's rows to read out (None: those its sampling and prompt logprobs need)."""
        seq = chunk.seq
        end = chunk.start + chunk.num_new_tokens
        if rows is not None:
            logits_at = rows
        else:
            logits_at = [p - chunk.start for p in self._prompt_logprob_positions(seq, chunk.start, end)]
            if chunk.completes_known_tokens:
                logits_at += range(chunk.num_new_tokens - 1 - chunk.num_drafts, chunk.num_new_tokens)
        tokens = (seq.all_token_ids + seq.draft_token_ids)[chunk.start : end]
        table = self.kv.block_table(seq.seq_id)
        images = seq.request.images
        lora_slot = self.adapters.slot_of(seq.request.lora_name) if self.adapters is not None else -1
        if images is None:
            return SequenceSlice(tokens, chunk.start, table, logits_at, lora_slot=lora_slot)
        image_at, image_rows = images.in_range(chunk.start, end)
        return SequenceSlice(tokens, chunk.start, table, logits_at, image_at, image_rows, lora_slot)

    @staticmethod
    def _prompt_logprob_positions(seq: Sequence, start: int, end: int) -> range:
        """Prompt positions in [start, end) whose next-token logprob this request still lacks."""
        collected = seq.request.prompt_logprobs
        if collected is None or seq.index != 0:
            return range(0)
        first = max(start, len(collected) - 1)
        return range(first, min(end, len(seq.prompt_token_ids) - 1))

    def _add_prompt_logprobs(self, request: Request, chunk: ScheduledChunk, rows: Logits) -> None:
        assert request.prompt_logprobs is not None and request.params.prompt_logprobs is not None
        first = len(request.prompt_logprobs)
        next_tokens = request.prompt_token_ids[first : first + rows.shape[0]]
        request.prompt_logprobs.extend(prompt_logprobs(rows, next_tokens, request.params.prompt_logprobs))

    def _sample_and_update(
        self, logits: Logits, to_sample: list[tuple[Sequence, int]], touched: dict[str, Request]
    ) -> None:
        indices = [row for _, row in to_sample]
        # the sampler copies what it changes, so the common case (every row, in order) needs no copy
        rows = logits if indices == list(range(logits.shape[0])) else logits[indices]
        states = [self._states[seq.seq_id] for seq, _ in to_sample]
        bitmask = self.grammars.bitmask([state.constraint for state in states])
        samplings = [state.sampling for state in states]
        eos = self.tokenizer.eos_token_ids
        sampled_tokens = sample(rows, samplings, eos_token_ids=eos, token_bitmask=bitmask)
        for (seq, _), sampled, state in zip(to_sample, sampled_tokens, states, strict=True):
            request = seq.request
            touched[request.request_id] = request
            self._release_held(request)
            if state.constraint is not None:
                state.constraint.accept(sampled.token_id)
            self._append_token(seq, sampled.token_id, sampled.logprob, sampled.top_logprobs)

    def _verify(self, seq: Sequence, rows: Logits, num_drafts: int, touched: dict[str, Request]) -> None:
        """The speculating sequence's rows through the verifier; the accepted drafts count as computed."""
        assert self.spec_decoder is not None
        state = self._states[seq.seq_id]
        request = seq.request
        touched[request.request_id] = request
        self._release_held(request)  # the prompt's last token may be the one that speculates

        def sample_row(row: Logits, draft: int | None, q: np.ndarray | None) -> int:
            bitmask = self.grammars.bitmask([state.constraint])  # its state after the tokens so far
            (sampled,) = sample(
                row,
                [state.sampling],
                self.tokenizer.eos_token_ids,
                token_bitmask=bitmask,
                drafts=[draft],
                draft_probs=[q],
            )
            if state.constraint is not None:
                state.constraint.accept(sampled.token_id)
            self._append_token(seq, sampled.token_id, sampled.logprob, sampled.top_logprobs)
            return sampled.token_id

        accepted = self.spec_decoder.verify(seq, rows, num_drafts, sample_row)
        if not seq.is_finished:
            seq.num_computed_tokens += accepted
            self._cache_full_blocks(seq, write_through=False)

    def _cache_full_blocks(self, seq: Sequence, write_through: bool) -> None:
        """Register the blocks `seq` filled. With offload tiers, a prompt's blocks go to them at once (a
        crash keeps them); a decoded block when the pool evicts it, or when the engine closes or sleeps."""
        registered = self.kv.cache_full_blocks(
            seq.seq_id, seq.cache_key_ids, seq.num_computed_tokens, seq.request.cache_salt
        )
        if registered and write_through and self.offload is not None:
            self.offload.save(registered)

    def _release_held(self, request: Request) -> None:
        """n > 1: once the first sample's prompt is computed (and its blocks cached), admit the rest."""
        held = self._held.pop(request.request_id, [])
        for seq in reversed(held):
            self.scheduler.add(seq, front=True)

    def _append_token(
        self, seq: Sequence, token: int, logprob: float | None, top: TokenLogprobs | None
    ) -> None:
        state = self._states[seq.seq_id]
        seq.output_token_ids.append(token)
        self.stats.num_generation_tokens += 1
        state.new_token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if seq.params.logprobs is not None and top is not None:
            seq.logprobs.append(top)
            state.new_logprobs.append(top)
        params = seq.params
        ends_on_eos = (
            token in self.tokenizer.eos_token_ids
            and not params.ignore_eos
            and len(seq.output_token_ids) >= params.min_tokens
        )
        # the EOS that ends a sequence is not text, even where special tokens are kept (vLLM's way)
        keep_text = not ends_on_eos or params.include_stop_str_in_output
        stop_string = state.detokenizer.add_token(token) if keep_text else None
        reason = self._finish_reason(seq, token, stop_string)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            seq.status = SequenceStatus.FINISHED
            state.detokenizer.finish()
            self.scheduler.remove(seq)

    def _finish_reason(
        self, seq: Sequence, token: int, stop_string: str | None
    ) -> tuple[str, int | str | None] | None:
        params = seq.params
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if stop_string is not None:
                return "stop", stop_string
        if num_output >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    # -- outputs ----------------------------------------------------------------------------------

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.sequences:
            state = self._states[seq.seq_id]
            want_logprobs = request.params.logprobs is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=state.detokenizer.text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                    logprobs=list(seq.logprobs) if want_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=state.detokenizer.take_delta(),
                    delta_token_ids=state.new_token_ids,
                    delta_logprobs=state.new_logprobs if want_logprobs else None,
                )
            )
            state.new_token_ids, state.new_logprobs = [], []
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
            for seq in request.sequences:
                self._states.pop(seq.seq_id, None)
        first = request.sequences[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=completions,
            finished=finished,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
            weight_version=self.weight_version,
            embedding=request.embedding,
        )

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until every request is finished; the final output of each, in the order they finished."""
        finished: list[RequestOutput] = []
        while self.has_unfinished_requests():
            finished += [output for output in self.step() if output.finished]
        return finished
