"""Tensor-parallel execution on one machine: rank 0 lives in the engine's process and runs its shard;
ranks 1.. are worker processes that run theirs. Before each step rank 0 broadcasts the step's inputs
(one int64 header, one int64 payload); the collectives inside the sharded step (passes/shard.py) join
the ranks, and every rank ends with the whole logits. Each rank owns its shard of the KV cache, with
the engine's block count and size (so the engine's block tables address every shard).

New weights (docs/weight-updates.md) travel the same way, between steps: a WEIGHTS header with each
worker's payload size, then each worker's shard (safetensors bytes) sent to it alone; every worker
loads its shard and answers whether it could, and rank 0 broadcasts COMMIT (all serve the new weights)
or ABORT (all keep the old).

A worker that exits makes the next step raise instead of waiting on it; the process group's timeout
bounds a collective that a dying worker leaves half done.

Under `torchrun` (one process per rank, on one node or several) nothing is spawned: every process
joins the group from torchrun's environment (`env://`), rank 0 runs the engine and ranks 1.. run
`run_worker` until rank 0 stops.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.backends.base import BackendError, Executable, Logits
from kiln.ir import StepInputs
from kiln.ir.step import STEP as STEP_ENTRY
from kiln.runtime.weights_file import read_weights_file

if TYPE_CHECKING:
    import torch

STOP, CACHE, STEP, WEIGHTS, COMMIT, ABORT = 0, 1, 2, 3, 4, 5
HEADER = 8  # a WEIGHTS header holds each worker's payload size: at most 7 workers
TIMEOUT = datetime.timedelta(seconds=120)
FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


@dataclass(frozen=True)
class CompiledRanks:
    """Makes rank r's executable: the `backend`'s code for `target` compiled into `folders[r]`, with the
    rank's weights from the safetensors file `weights[r]` (an artifact's rank entries). Picklable, so a
    spawned worker makes its own."""

    backend: str
    target: str
    folders: tuple[str, ...]
    weights: tuple[str, ...]

    def __call__(self, rank: int) -> Executable:

        return self.with_weights(rank, read_weights_file(Path(self.weights[rank])))

    def with_weights(self, rank: int, weights: dict[str, Any]) -> Executable:
        """Rank r's executable with other weights (stored as its code reads them: a weight update)."""
        from kiln.backends.registry import get_backend
        from kiln.backends.targets import Target

        return get_backend(self.backend).load(Path(self.folders[rank]), weights, Target.parse(self.target))


def _pack(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    tables = inputs.block_tables
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[:5] = torch.tensor(
        [STEP, inputs.token_ids.size, tables.shape[0], tables.shape[1], inputs.logits_indices.size]
    )
    parts = [getattr(inputs, name).reshape(-1) for name in FIELDS] + [inputs.logits_indices]
    return header, torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def _unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    tokens, seqs, width, logits = (int(v) for v in header[1:5])
    sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, logits]
    pieces = np.split(payload.numpy(), np.cumsum(sizes)[:-1])
    pieces[3] = pieces[3].reshape(seqs, width)
    return StepInputs(**dict(zip((*FIELDS, "logits_indices"), pieces, strict=True)))


def _payload_size(header: torch.Tensor) -> int:
    tokens, seqs, width, logits = (int(v) for v in header[1:5])
    return 3 * tokens + seqs * width + 2 * seqs + 1 + logits


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) where torchrun started this process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


THREADS_VARIABLE = "TVM_NUM_THREADS"  # read by TVM's thread pool when it starts (in a rank: at load)


def _share_cores(ranks_here: int) -> None:
    """Each rank gets its share of this machine's cores for torch's threads and TVM's (more would
    oversubscribe them: a rank that waits in a collective for one that has no core is time lost by all).
    A process whose TVM thread pool already runs keeps its size."""
    import torch

    share = max(1, (os.cpu_count() or 1) // ranks_here)
    torch.set_num_threads(share)
    os.environ[THREADS_VARIABLE] = str(share)


def _restore_threads(threads: int, variable: str | None) -> None:
    import torch

    torch.set_num_threads(threads)
    if variable is None:
        os.environ.pop(THREADS_VARIABLE, None)
    else:
        os.environ[THREADS_VARIABLE] = variable


def _ranks_here(world: int) -> int:
    """The ranks on this machine: all of them, or torchrun's count for this node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun_rank() else world


def run_worker(make: Callable[[int], Executable]) -> None:
    """Rank 1.. of a torchrun launch: step with rank 0 until it stops."""
    launch = torchrun_rank()
    if launch is None or launch[0] == 0:
        raise BackendError("run_worker is for ranks 1.. started by torchrun")
    try:
        _worker(launch[0], launch[1], "env://", make)
    except RuntimeError as error:  # rank 0 went away without stopping the ranks
        raise BackendError(f"tensor-parallel rank {launch[0]} lost rank 0 ({error}); stopping") from None


def _worker(rank: int, world: int, init_method: str, make: Callable[[int], Executable]) -> None:
    import torch
    import torch.distributed as dist

    _share_cores(_ranks_here(world))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
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
            if kind == WEIGHTS:
                executable = _take_weights(rank, header, make, executable)
                continue
            payload = torch.empty(_payload_size(header), dtype=torch.int64)
            dist.broadcast(payload, 0)
            assert cache is not None, "a step before the KV cache"
            executable.step(_unpack(header, payload), cache)
    finally:
        dist.destroy_process_group()


def _take_weights(
    rank: int, header: torch.Tensor, make: Callable[[int], Executable], serving: Executable
) -> Executable:
    """A worker's side of a weight update: receive its shard, make its executable, say whether it could,
    then serve it on COMMIT (or keep `serving` on ABORT)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load

    payload = torch.empty(int(header[rank]), dtype=torch.uint8)
    dist.recv(payload, 0)
    staged: Executable | None = None
    try:
        staged = make.with_weights(rank, load(payload.numpy().tobytes()))  # type: ignore[attr-defined]
    except Exception as error:  # the update is refused whole: rank 0 says ABORT
        print(f"kiln: tensor-parallel rank {rank} cannot load the new weights: {error}", flush=True)
    dist.send(torch.tensor([int(staged is not None)], dtype=torch.int64), 0)
    dist.broadcast(header, 0)
    return staged if int(header[0]) == COMMIT and staged is not None else serving


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TensorParallelExecutable(Executable):
    """Rank 0 of `world`, started with its worker processes (or joined by torchrun's); an Executable
    for the engine."""

    sleeps = False  # its workers hold their own KV caches and weights: no sleep mode (live_weights.py)

    def __init__(self, make: Callable[[int], Executable], world: int) -> None:
        import torch
        import torch.distributed as dist

        if world < 2:
            raise ValueError(f"tensor parallelism needs at least 2 ranks, got {world}")
        if dist.is_initialized():
            raise BackendError("this process already belongs to a process group; one model a process")
        launch = torchrun_rank()
        if launch is not None and launch != (0, world):
            raise BackendError(
                f"torchrun started this process as rank {launch[0]} of {launch[1]}; the model has {world} "
                "ranks and runs its engine on rank 0",
                hint=f"launch torchrun with {world} processes in all; ranks 1.. run `kiln serve` too",
            )
        self.world = world
        self._threads = torch.get_num_threads(), os.environ.get(THREADS_VARIABLE)  # given back by close()
        _share_cores(_ranks_here(world))
        try:
            self.executable = make(0)  # first: a model that does not split fails before a worker starts
        except BaseException:
            _restore_threads(*self._threads)
            raise
        # its workers take the contract's inputs only, and it has no `embed`
        self.signature = self.executable.signature.with_entry_points((STEP_ENTRY,), None)
        self.kv_cache_device = self.executable.kv_cache_device
        self.workers: list[multiprocessing.process.BaseProcess] = []
        init_method = "env://"
        if launch is None:
            port = _free_port()
            init_method = f"tcp://127.0.0.1:{port}"
            context = multiprocessing.get_context("spawn")
            self.workers = [
                context.Process(target=_worker, args=(rank, world, init_method, make), daemon=True)
                for rank in range(1, world)
            ]
            for worker in self.workers:
                worker.start()
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=world, timeout=TIMEOUT)
        self._cache: torch.Tensor | None = None
        self._closed = False

    def step(self, inputs: StepInputs, kv_cache: torch.Tensor) -> Logits:
        import torch
        import torch.distributed as dist

        self._check_workers()
        if inputs.optional:
            raise BackendError(f"tensor-parallel steps take no {', '.join(inputs.optional)}")
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

    def replace_weights(self, rank0: Executable, shards: list[dict[str, torch.Tensor]]) -> None:
        """Serve new weights on every rank: `rank0`, this process's executable of them, and each worker's
        shard (stored as its code reads them). Run between steps on the engine's thread: the shards go
        over the step's process group. Two phases: every worker loads its shard, then all serve them
        (COMMIT), or, if one could not, none does (ABORT, BackendError) and the old weights serve on."""
        import torch
        import torch.distributed as dist
        from safetensors.torch import save

        self._check_workers()
        if len(shards) != self.world - 1 or self.world > HEADER:
            raise BackendError(f"{len(shards)} shards for {self.world - 1} workers (at most {HEADER - 1})")
        payloads = [
            torch.frombuffer(
                bytearray(save({n: t.contiguous() for n, t in shard.items()})), dtype=torch.uint8
            )
            for shard in shards
        ]
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = WEIGHTS
        for rank, payload in enumerate(payloads, start=1):
            header[rank] = payload.numel()
        try:
            dist.broadcast(header, 0)
            for rank, payload in enumerate(payloads, start=1):
                dist.send(payload, rank)
            loaded = []
            for rank in range(1, self.world):
                answer = torch.zeros(1, dtype=torch.int64)
                dist.recv(answer, rank)
                loaded.append(bool(answer[0]))
            header.zero_()
            header[0] = COMMIT if all(loaded) else ABORT
            dist.broadcast(header, 0)
        except RuntimeError as error:  # a collective whose peer went away
            self._check_workers()
            raise BackendError(f"a tensor-parallel collective failed: {error}") from None
        if not all(loaded):
            failed = [rank for rank, ok in enumerate(loaded, start=1) if not ok]
            raise BackendError(
                f"tensor-parallel rank(s) {failed} could not load the new weights; every rank keeps the old"
            )
        self.executable = rank0

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
        import torch
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        intact = all(worker.is_alive() for worker in self.workers)
        if intact:
            try:
                dist.broadcast(torch.zeros(HEADER, dtype=torch.int64), 0)  # STOP
            except RuntimeError:  # a torchrun rank that is gone already
                pass
        for worker in self.workers:
            worker.join(30 if intact else 0)  # beside a dead rank the others wait on it in a collective
            if worker.is_alive():
                worker.kill()
                worker.join()
        dist.destroy_process_group()
        _restore_threads(*self._threads)


@dataclass
class StagedRanks:
    """New weights for every rank of `ranks` (a live_weights.StagedWeights): rank 0's executable of them
    and each worker's shard, put in place by `commit` on the engine's thread."""

    ranks: TensorParallelExecutable
    rank0: Executable
    shards: list[dict[str, Any]]

    def commit(self) -> Executable:
        self.ranks.replace_weights(self.rank0, self.shards)
        return self.ranks
