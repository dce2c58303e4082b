"""Weights from a trainer process over torch.distributed: the trainer is rank 0 of a group it hosts
(a TCPStore at `master_address:master_port`), the server joins as rank `rank_offset` (1 with one
server), and each update the trainer broadcasts the tensors one by one, in the order both sides were
told (vLLM's `init_weight_transfer_engine` / `update_weights`). Gloo on CPUs; NCCL where both sides
have a GPU.

The group is its own (a ProcessGroup object, not torch.distributed's default group), so a server that
runs tensor-parallel ranks keeps its own group apart. A trainer that dies mid-broadcast breaks the
group: the broadcast raises (gloo sees the closed connection at once; a silent peer is bounded by the
timeout), the update is dropped whole, and the trainer must join again.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.runtime.live_weights import WeightUpdateError

if TYPE_CHECKING:
    import torch

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TransferGroup:
    """Where the trainer's group is and this process's place in it."""

    master_address: str
    master_port: int
    rank: int  # this process's rank (the trainer is 0)
    world_size: int
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: give one of {', '.join(BACKENDS)}")
        if not 0 <= self.rank < self.world_size or self.world_size < 2:
            raise ValueError(
                f"rank {self.rank} of world_size {self.world_size}: the trainer is rank 0, a server a rank "
                "from 1 to world_size - 1"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is no TCP port")

    def join(self) -> Channel:
        """Join the group (blocks until every rank has joined, at most the timeout)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            store = dist.TCPStore(
                self.master_address, self.master_port, self.world_size, self.rank == 0, timeout=timeout
            )
            if self.backend == "nccl":
                group = dist.ProcessGroupNCCL(store, self.rank, self.world_size)
            else:
                group = dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)
        except (RuntimeError, ValueError, OSError) as error:  # torch.distributed's DistError is one
            raise WeightUpdateError(
                f"cannot join the weight-transfer group at {self.master_address}:{self.master_port} as rank "
                f"{self.rank} of {self.world_size} ({self.backend}): {error}",
                hint="start the trainer's side (rank 0) at the same time, at that address and port",
            ) from None
        return Channel(store, group, "cuda" if self.backend == "nccl" else "cpu")


class Channel:
    """A joined group: broadcasts from rank 0."""

    def __init__(self, store: object, group: object, device: str) -> None:
        self._store = store  # kept: the group's rendezvous lives as long as it
        self._group = group
        self.device = device
        self.broken: str | None = None  # why the group can no longer be used

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0: broadcast each tensor."""
        for tensor in tensors:
            self._broadcast(tensor.detach().to(self.device).contiguous())

    def receive(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        keep: Callable[[int], bool] = lambda index: True,
    ) -> dict[str, torch.Tensor]:
        """The tensors rank 0 broadcasts (`dtypes` named as torch names them: float32, ...), by name;
        those `keep` refuses are received and let go (so the trainer's broadcast completes). A broken
        transfer raises WeightUpdateError naming the tensor."""
        import torch

        received: dict[str, torch.Tensor] = {}
        for index, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            try:
                self._broadcast(tensor)
            except RuntimeError as error:
                self.broken = (
                    f"the transfer broke off at tensor {index + 1} of {len(names)} ({name}): {error}"
                )
                raise WeightUpdateError(
                    self.broken + "; the served weights are unchanged",
                    hint="join again (POST /init_weight_transfer_engine) and push the weights again",
                ) from None
            if keep(index):
                received[name] = tensor.cpu()
        return received

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        if self.broken is not None:
            raise WeightUpdateError(self.broken, hint="join the weight-transfer group again")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]
