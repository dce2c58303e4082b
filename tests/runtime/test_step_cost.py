"""The step-cost model: what it learns from step times, and the prompt tokens it lets a step add."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.step_cost import MIN_PREFILL_TOKENS, WINDOW, StepCostModel


def _decoding(model: StepCostModel, base: float = 0.004, per_row: float = 0.0015) -> StepCostModel:
    for rows in range(1, 17):
        model.observe(rows, 0, base + per_row * rows)
    return model


def test_nothing_is_limited_before_a_decode_and_a_prompt_step_were_measured() -> None:
    model = StepCostModel()
    assert model.prefill_budget(4) is None
    model.observe(4, 0, 0.010)
    assert model.prefill_budget(4) is None  # no prompt cost yet
    model.observe(4, 8, 0.011)
    assert model.prefill_budget(4) is None  # a few prompt tokens say little of a chunk's cost
    model.observe(4, 100, 0.060)
    assert model.prefill_budget(4) is not None
    assert model.prefill_budget(0) is None  # nothing decodes: nothing to stall


def test_one_line_through_the_decode_steps_of_every_row_count() -> None:
    model = _decoding(StepCostModel())
    assert model.decode_step(10) == pytest.approx(0.004 + 0.0015 * 10)
    model.observe(10, 0, 0.500)  # one noisy step moves the line a little, not its row count's budget
    assert model.decode_step(10) == pytest.approx(0.004 + 0.0015 * 10, rel=0.1)


def test_a_prompt_gets_as_much_of_a_step_as_the_decodes_by_default() -> None:
    model = _decoding(StepCostModel())
    decode = 0.004 + 0.0015 * 12
    model.observe(12, 100, decode + 100 * 0.0005)
    assert model.prefill_seconds_per_token == pytest.approx(0.0005)
    assert model.prefill_budget(12) == pytest.approx(decode / 0.0005, abs=1)  # (2 x decode - decode) / cost


def test_a_step_time_target_sets_the_budget() -> None:
    model = _decoding(StepCostModel(max_step_ms=50.0))
    model.observe(4, 100, 0.010 + 100 * 0.0005)
    assert model.prefill_budget(4) == pytest.approx((0.050 - 0.010) / 0.0005, abs=1)


def test_every_step_with_decodes_still_computes_some_prompt() -> None:
    model = _decoding(StepCostModel(max_step_ms=1.0))  # below the decodes' own step
    model.observe(4, 100, 0.060)
    assert model.prefill_budget(4) == MIN_PREFILL_TOKENS


def test_the_prompt_cost_follows_the_newest_chunks() -> None:
    model = _decoding(StepCostModel())
    model.observe(0, 512, 512 * 0.0005)  # a whole prefill, cheap a token
    for _ in range(8):  # small chunks beside decodes cost four times as much a token
        model.observe(12, 16, 0.004 + 0.0015 * 12 + 16 * 0.002)
    assert model.prefill_seconds_per_token == pytest.approx(0.002, rel=0.01)


def test_the_line_fits_only_the_newest_window_of_steps() -> None:
    model = StepCostModel()
    rng = np.random.default_rng(0)
    steps = [(int(rng.integers(1, 17)), float(rng.uniform(0.004, 0.030))) for _ in range(3 * WINDOW + 5)]
    for rows, seconds in steps:
        model.observe(rows, 0, seconds)
    kept = np.asarray(model.decode_steps)  # as the model counted them (outliers capped)
    assert len(kept) == WINDOW
    per_row, base = np.polyfit(kept[:, 0], kept[:, 1], 1)
    assert model.decode_line == pytest.approx((base, per_row), rel=1e-9, abs=1e-12)
