"""Collectives of tensor parallelism, and the vocabulary-parallel embedding they need.

The reference runs them through `torch.distributed` on the default process group (gloo on the CPU,
NCCL on GPUs), which the runtime initialises with one process per rank; with no group, or a group of
one, they are the identity (all_gather then needs `world` 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kiln.ir.ops.registry import OpDef, register, require, required
from kiln.ir.types import TensorType


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_world(world: int) -> None:
    if world_size() != world:
        raise RuntimeError(
            f"this graph is one rank of {world}, but the process group has {world_size()} processes; "
            f"run it with {world} ranks (torch.distributed initialised with world_size {world})"
        )


def all_reduce(x: torch.Tensor, *, world: int) -> torch.Tensor:
    _check_world(world)
    if world == 1:
        return x
    summed = x.contiguous().clone()
    dist.all_reduce(summed)
    return summed


def all_gather(x: torch.Tensor, *, world: int, dim: int) -> torch.Tensor:
    _check_world(world)
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def _infer_all_reduce(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    require(int(attrs.get("world", 0)) >= 1, "all_reduce needs world >= 1")
    return [x]


def _infer_all_gather(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    x = required(inputs[0], "x")
    world, dim = int(attrs.get("world", 0)), int(attrs.get("dim", -1))
    require(world >= 1, "all_gather needs world >= 1")
    require(-x.rank <= dim < x.rank, f"all_gather dim {dim} is outside a rank-{x.rank} tensor")
    size = x.shape[dim]
    require(isinstance(size, int), f"all_gather gathers a static dim; dim {dim} is {size}")
    shape = list(x.shape)
    shape[dim] = size * world
    return [TensorType(x.dtype, tuple(shape))]


def shard_embedding(weight: torch.Tensor, ids: torch.Tensor, vocab_start: torch.Tensor) -> torch.Tensor:
    """Rows of this rank's slice of the table for ids in [vocab_start, vocab_start + rows); zeros for the
    others (an all_reduce over the ranks then gives every id its row). `vocab_start` is a one-element
    tensor, so every rank's graph is the same."""
    local = ids - vocab_start.to(ids.dtype)
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    return rows * inside.unsqueeze(-1).to(rows.dtype)


def _infer_shard_embedding(inputs: Sequence[TensorType | None], attrs: dict[str, Any]) -> list[TensorType]:
    weight, ids = required(inputs[0], "weight"), required(inputs[1], "ids")
    start = required(inputs[2], "vocab_start")
    require(weight.rank == 2, "shard_embedding weight must be 2-D")
    require(ids.dtype in ("i32", "i64"), f"ids must be integers, got {ids.dtype}")
    require(start.dtype == "i64" and start.shape == (1,), f"vocab_start must be i64[1], got {start}")
    return [TensorType(weight.dtype, (*ids.shape, weight.shape[1]))]


register(
    OpDef(
        "all_reduce",
        (1, 1),
        {"world": "ranks in the group"},
        _infer_all_reduce,
        all_reduce,
        pure=False,
        doc="sum of x over the ranks",
    )
)
register(
    OpDef(
        "all_gather",
        (1, 1),
        {"world": "ranks in the group", "dim": "the dim the ranks' parts are joined along"},
        _infer_all_gather,
        all_gather,
        pure=False,
        doc="the ranks' x joined along dim, in rank order",
    )
)
register(
    OpDef(
        "shard_embedding",
        (3, 3),
        {},
        _infer_shard_embedding,
        shard_embedding,
        doc="rows of a vocabulary slice weight[V / tp, H] at ids, zeros outside it; vocab_start: i64[1], "
        "the slice's first id",
    )
)
