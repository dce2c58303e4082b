"""Tensor-parallel execution on one machine: rank 0 lives in the engine's process and runs its shard;
ranks 1.. are worker processes that run theirs. Before each step rank 0 broadcasts the step's inputs
(one int64 header, one int64 payload); the collectives inside the sharded step (passes/shard.py) join
the ranks, and every rank ends with the whole logits. Each rank owns its shard of the KV cache, with
the engine's block count and size (so the engine's block tables address every shard).

A worker that exits makes the next step raise instead of waiting on it; the process group's timeout
bounds a collective that a dying worker leaves half done.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln.backends.base import BackendError, Executable
from kiln.ir import StepInputs

STOP, CACHE, STEP = 0, 1, 2
HEADER = 8
TIMEOUT = datetime.timedelta(seconds=120)
FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


@dataclass(frozen=True)
class ReferenceRanks:
    """Makes rank r's executable: `model` built with `options` for that rank, on the reference backend.
    Picklable, so a spawned worker can make its own."""

    model: str
    options: Any  # kiln.build.PipelineOptions, with tensor_parallel_size set

    def __call__(self, rank: int) -> Executable:
        from kiln.backends.reference import ReferenceExecutable
        from kiln.build import build_program

        program = build_program(self.model, dataclasses.replace(self.options, rank=rank)).program
        return ReferenceExecutable(program.graph, program.weights)


def _pack(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    tables = inputs.block_tables
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[:5] = torch.tensor(
        [STEP, inputs.token_ids.numel(), tables.shape[0], tables.shape[1], inputs.logits_indices.numel()]
    )
    parts = [getattr(inputs, name).reshape(-1) for name in FIELDS] + [inputs.logits_indices]
    return header, torch.cat(parts).to(torch.int64)


def _unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    tokens, seqs, width, logits = (int(v) for v in header[1:5])
    sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, logits]
    pieces = list(torch.split(payload, sizes))
    pieces[3] = pieces[3].reshape(seqs, width)
    return StepInputs(**dict(zip((*FIELDS, "logits_indices"), pieces, strict=True)))


def _payload_size(header: torch.Tensor) -> int:
    tokens, seqs, width, logits = (int(v) for v in header[1:5])
    return 3 * tokens + seqs * width + 2 * seqs + 1 + logits


def _share_cores(world: int) -> None:
    """Each rank gets its share of this machine's cores for torch's threads (more would oversubscribe
    them: a rank that waits in a collective for one that has no core is time lost by all)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def _worker(rank: int, world: int, port: int, make: Callable[[int], Executable]) -> None:
    _share_cores(world)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        executable = make(rank)
        cache: torch.Tensor | None = None
        header = torch.zeros(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0)
            kind = int(header[0])
            if kind == STOP:
                return
            if kind == CACHE:
                cache = executable.kv_cache_spec.allocate(int(header[1]), int(header[2]))
                continue
            payload = torch.empty(_payload_size(header), dtype=torch.int64)
            dist.broadcast(payload, 0)
            assert cache is not None, "a step before the KV cache"
            executable.step(_unpack(header, payload), cache)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TensorParallelExecutable:
    """Rank 0 of `world`, started with its worker processes; an Executable for the engine."""

    def __init__(self, make: Callable[[int], Executable], world: int) -> None:
        if world < 2:
            raise ValueError(f"tensor parallelism needs at least 2 ranks, got {world}")
        if dist.is_initialized():
            raise BackendError("this process already belongs to a process group; one model a process")
        self.world = world
        self._threads = torch.get_num_threads()  # this process's own, given back by close()
        _share_cores(world)
        try:
            self.executable = make(0)  # first: a model that does not split fails before a worker starts
        except BaseException:
            torch.set_num_threads(self._threads)
            raise
        self.kv_cache_spec = self.executable.kv_cache_spec
        port = _free_port()
        context = multiprocessing.get_context("spawn")
        self.workers = [
            context.Process(target=_worker, args=(rank, world, port, make), daemon=True)
            for rank in range(1, world)
        ]
        for worker in self.workers:
            worker.start()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world, timeout=TIMEOUT
        )
        self._cache: torch.Tensor | None = None
        self._closed = False

    def step(self, inputs: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self._check_workers()
        try:
            if kv_cache is not self._cache:
                header = torch.zeros(HEADER, dtype=torch.int64)
                header[:3] = torch.tensor([CACHE, kv_cache.shape[2], kv_cache.shape[3]])
                dist.broadcast(header, 0)
                self._cache = kv_cache
            header, payload = _pack(inputs)
            dist.broadcast(header, 0)
            dist.broadcast(payload, 0)
            return self.executable.step(inputs, kv_cache)
        except RuntimeError as error:  # a collective whose peer went away
            for worker in self.workers:
                worker.join(2)
            self._check_workers()
            raise BackendError(f"a tensor-parallel collective failed: {error}") from None

    def _check_workers(self) -> None:
        if self._closed:
            raise BackendError("the tensor-parallel workers were stopped")
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise BackendError(
                    f"tensor-parallel rank {rank} exited (code {worker.exitcode}); the model cannot step",
                    hint="see the worker's error in the log; restart the server",
                )

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        if self._closed:
            return
        self._closed = True
        if all(worker.is_alive() for worker in self.workers):
            dist.broadcast(torch.zeros(HEADER, dtype=torch.int64), 0)  # STOP
        for worker in self.workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
        dist.destroy_process_group()
        torch.set_num_threads(self._threads)
