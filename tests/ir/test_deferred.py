"""Deferred weights: typed now, computed when materialized; parts of one computation computed once."""

import pytest
import torch

from kiln.ir.deferred import Deferred, concatenated, materialize, reshaped, shared_parts


def _counting(value: torch.Tensor) -> tuple[Deferred, list[int]]:
    calls: list[int] = []

    def make() -> torch.Tensor:
        calls.append(1)
        return value.clone()

    return Deferred(value.shape, value.dtype, make), calls


def test_nothing_is_computed_until_materialized() -> None:
    weight, calls = _counting(torch.arange(6.0).reshape(2, 3))
    joined = concatenated([weight, torch.ones(1, 3)])
    half = reshaped(joined, (-1,)).to(torch.float16)
    assert (half.shape, half.dtype, half.numel(), half.element_size()) == ((9,), torch.float16, 9, 2)
    assert calls == []
    assert torch.equal(materialize(half), torch.tensor([0, 1, 2, 3, 4, 5, 1, 1, 1], dtype=torch.float16))
    assert calls == [1]


def test_a_broken_promise_is_named() -> None:
    wrong = Deferred((2, 2), torch.float32, lambda: torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"promised torch.float32 \[2, 2\] and made torch.float32 \[3\]"):
        wrong.materialize()


def test_shared_parts_compute_once_and_let_go_when_all_were_taken() -> None:
    calls: list[int] = []

    def make() -> tuple[torch.Tensor, torch.Tensor, None]:
        calls.append(1)
        return torch.ones(4, 2, dtype=torch.int8), torch.full((4, 1), 0.5), None

    q, scales, zeros = shared_parts(make, [((4, 2), torch.int8), ((4, 1), torch.float32), None])
    assert zeros is None and q is not None and scales is not None
    assert torch.equal(q.materialize(), torch.ones(4, 2, dtype=torch.int8))
    assert torch.equal(scales.materialize(), torch.full((4, 1), 0.5))
    assert calls == [1]
    q.materialize()  # taken again after all were: computed again, nothing was kept
    assert calls == [1, 1]
