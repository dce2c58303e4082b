"""The step-cost model: what it learns from step times, and the prompt tokens it lets a step add."""

from __future__ import annotations

import pytest

from kiln.runtime.step_cost import MIN_PREFILL_TOKENS, StepCostModel


def test_nothing_is_limited_before_a_decode_and_a_prefill_step_were_measured() -> None:
    model = StepCostModel()
    assert model.prefill_budget(4) is None
    model.observe(4, 0, 0.010)
    assert model.prefill_budget(4) is None  # no prompt cost yet
    model.observe(4, 100, 0.060)
    assert model.prefill_budget(0) is None  # nothing decodes: nothing to stall


def test_a_prompt_gets_as_much_of_a_step_as_the_decodes_by_default() -> None:
    model = StepCostModel()
    model.observe(4, 0, 0.010)
    model.observe(4, 100, 0.060)  # 50 ms beyond the decodes' 10 ms: 0.5 ms a prompt token
    assert model.prefill_seconds_per_token == pytest.approx(5e-4)
    assert model.prefill_budget(4) == 20  # (2 x 10 ms - 10 ms) / 0.5 ms


def test_a_step_time_target_sets_the_budget() -> None:
    model = StepCostModel(max_step_ms=50.0)
    model.observe(4, 0, 0.010)
    model.observe(4, 100, 0.060)
    assert model.prefill_budget(4) == 80  # (50 ms - 10 ms) / 0.5 ms


def test_every_step_with_decodes_still_computes_some_prompt() -> None:
    model = StepCostModel(max_step_ms=1.0)  # below the decodes' own step
    model.observe(4, 0, 0.010)
    model.observe(4, 100, 0.060)
    assert model.prefill_budget(4) == MIN_PREFILL_TOKENS


def test_an_unmeasured_row_count_borrows_the_nearest_below_then_above() -> None:
    model = StepCostModel()
    model.observe(2, 0, 0.004)
    model.observe(8, 0, 0.010)
    assert model.decode_step(5) == 0.004
    assert model.decode_step(1) == 0.004
    assert model.decode_step(12) == 0.010


def test_the_estimates_follow_the_newest_steps() -> None:
    model = StepCostModel()
    model.observe(4, 0, 0.010)
    for _ in range(40):
        model.observe(4, 0, 0.020)
    assert model.decode_step(4) == pytest.approx(0.020, rel=1e-3)
    model.observe(4, 8, 1.0)  # too few prompt tokens to say what one costs
    assert model.prefill_seconds_per_token is None
