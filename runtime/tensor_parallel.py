"""Tensor-parallel execution on one machine: rank 0 lives in the engine's process and runs its shard;
ranks 1.. are worker processes that run theirs. Before each step rank 0 broadcasts the step's inputs
(one int64 header, one int64 payload); the collectives inside the sharded step (passes/shard.py) join
the ranks, and every rank ends with the whole logits. Each rank owns its shard of the KV cache, with
the engine's block count and size (so the engine's block tables address every shard).

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
from typing import TYPE_CHECKING

import numpy as np

from kiln.backends.base import BackendError, Executable, Logits
from kiln.ir import StepInputs
from kiln.runtime.weights_file import read_weights_file

if TYPE_CHECKING:
    import torch

STOP, CACHE, STEP = 0, 1, 2
HEADER = 8
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
        from kiln.backends.registry import get_backend
        from kiln.backends.targets import Target

        weights = read_weights_file(Path(self.weights[rank]))
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
    """Rank 0 of `world`, started with its worker processes (or joined by torchrun's); an Executable
    for the engine."""

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
        self.kv_cache_spec = self.executable.kv_cache_spec
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
