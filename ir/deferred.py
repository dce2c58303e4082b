"""Weights whose values are made when they are needed: a compile holds the model as recipes, not bytes.

A `Deferred` knows its shape and dtype (all a graph, a pass's decisions and a backend's code generation
need) and computes its values on `materialize()`: dequantizing a GGUF tensor, importing its blocks,
quantizing, concatenating, casting. The artifact writer materializes one weight at a time, writes it
and lets it go, so a compile's memory does not grow with the model. Values are not kept: a weight
materialized twice is computed twice (the writer asks once), except the parts of one computation
(`shared_parts`: a quantizer's qweight, scales and zeros), computed once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Deferred:
    """A tensor of `shape` and `dtype` whose values `make()` computes on demand; `origin`: how the model
    file stores what it is made of, where that is not a float tensor ("compressed-tensors int4, ...")."""

    __slots__ = ("_make", "dtype", "origin", "shape")
    is_meta = False
    device = torch.device("cpu")

    def __init__(
        self, shape: Sequence[int], dtype: torch.dtype, make: Callable[[], torch.Tensor], origin: str = ""
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._make = make
        self.origin = origin

    def materialize(self) -> torch.Tensor:
        tensor = self._make()
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"a deferred weight promised {self.dtype} {list(self.shape)} and made "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        return tensor

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def dim(self) -> int:
        return len(self.shape)

    def to(self, dtype: torch.dtype) -> Deferred:
        if dtype == self.dtype:
            return self
        return Deferred(self.shape, dtype, lambda: self.materialize().to(dtype), self.origin)

    def then(
        self, shape: Sequence[int], dtype: torch.dtype, change: Callable[[torch.Tensor], torch.Tensor]
    ) -> Deferred:
        """The weight `change(values)`, of `shape` and `dtype`, deferred as this one is."""
        return Deferred(shape, dtype, lambda: change(self.materialize()))

    def __repr__(self) -> str:
        return f"Deferred({self.dtype}, {list(self.shape)})"


Weight = torch.Tensor | Deferred


def materialize(weight: Weight) -> torch.Tensor:
    """The values of a weight, deferred or not."""
    return weight.materialize() if isinstance(weight, Deferred) else weight


def meta(weight: Weight) -> torch.Tensor:
    """A meta tensor of the weight's shape and dtype (a stand-in where only those matter)."""
    return torch.empty(weight.shape, dtype=weight.dtype, device="meta")


def reshaped(weight: Weight, shape: Sequence[int]) -> Weight:
    """The weight reshaped (a view now, deferred where the weight is)."""
    if isinstance(weight, Deferred):
        size = meta(weight).reshape(tuple(shape)).shape
        return weight.then(size, weight.dtype, lambda values: values.reshape(size))
    return weight.reshape(*shape)


def concatenated(weights: Sequence[Weight]) -> Weight:
    """The weights joined along dim 0: now where all are tensors, deferred where any is."""
    if not any(isinstance(w, Deferred) for w in weights):
        return torch.cat(list(weights), dim=0)  # type: ignore[arg-type]
    shape = (sum(w.shape[0] for w in weights), *weights[0].shape[1:])
    return Deferred(shape, weights[0].dtype, lambda: torch.cat([materialize(w) for w in weights], dim=0))


def stacked(weights: Sequence[Weight]) -> Weight:
    """The weights stacked along a new dim 0: now where all are tensors, deferred where any is."""
    if not any(isinstance(w, Deferred) for w in weights):
        return torch.stack(list(weights))  # type: ignore[arg-type]
    shape = (len(weights), *weights[0].shape)
    return Deferred(shape, weights[0].dtype, lambda: torch.stack([materialize(w) for w in weights]))


class _Shared:
    """One computation's results, kept until each part has been taken once (then let go)."""

    def __init__(self, make: Callable[[], Sequence[torch.Tensor | None]], parts: set[int]) -> None:
        self._make = make
        self._parts = parts
        self._results: Sequence[torch.Tensor | None] | None = None
        self._waiting: set[int] = set()

    def part(self, index: int) -> torch.Tensor:
        if self._results is None:
            self._results = self._make()
            self._waiting = set(self._parts)
        result = self._results[index]
        assert result is not None
        self._waiting.discard(index)
        if not self._waiting:
            self._results = None
        return result


def shared_parts(
    make: Callable[[], Sequence[torch.Tensor | None]],
    types: Sequence[tuple[Sequence[int], torch.dtype] | None],
) -> list[Deferred | None]:
    """Deferred weights for the results of one computation (`types[i]`: result i's shape and dtype, None
    where it makes none): computed once whichever part is asked first, and kept until all were asked."""
    shared = _Shared(make, {i for i, t in enumerate(types) if t is not None})
    parts: list[Deferred | None] = []
    for index, kind in enumerate(types):
        if kind is None:
            parts.append(None)
            continue
        parts.append(Deferred(kind[0], kind[1], lambda index=index: shared.part(index)))
    return parts
