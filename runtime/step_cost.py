"""How long a step takes, learned from the steps this engine has run, and how many prompt tokens a step
may add to the running decodes without stalling them.

A step of `rows` decode rows and `p` prompt tokens takes about decode(rows) + p x per_token. Both are
measured as the engine runs, from the compiled step's wall time, so nothing is probed at start-up and
the estimates follow the machine's load:
- decode(rows): a least-squares line in the row count through the last `WINDOW` decode-only steps (one
  line for all row counts, each step counted as at most twice the line's prediction, so one stalled
  step does not set the budget of its row count for good);
- per_token: a moving average, weighted to the newest, of (step time - decode(rows)) / p over steps
  with at least `MIN_PREFILL_TOKENS` prompt tokens. The newest chunks are the best guide to the next:
  a token costs more in a small chunk than in a 512-token prefill, and more deep into a long prompt.

The step's time target is `max_step_ms` when given, else twice the decode rows' own step: a prompt may
take as much of a step as the decodes do, so a decoding stream's next token waits about twice its
undisturbed gap at most. At least `MIN_PREFILL_TOKENS` prompt tokens go into every step, so a prompt
always progresses, however cheap the decodes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_PREFILL_TOKENS = 16  # one KV block: the least prompt a step with decodes computes, and a sample's least
WINDOW = 64  # decode-only steps the line is fitted through
NEWEST_WEIGHT = 0.5  # weight of the newest step in the per-token average
OUTLIER_FACTOR = 2.0  # a decode step counts as at most this many times the line's prediction


@dataclass
class StepCostModel:
    max_step_ms: float | None = None  # None: twice the decode rows' own step
    decode_steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    decode_line: tuple[float, float] | None = None  # (base, per row) seconds
    prefill_seconds_per_token: float | None = None

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's compiled-step wall time, with what it computed."""
        if prefill_tokens == 0:
            predicted = self.decode_step(decode_rows)
            if predicted:  # one stalled step (a page fault, another process) moves the line only so far
                seconds = min(seconds, OUTLIER_FACTOR * predicted)
            self.decode_steps.append((decode_rows, seconds))
            self.decode_line = _line(self.decode_steps)
        elif prefill_tokens >= MIN_PREFILL_TOKENS:
            beyond_decodes = max(seconds - (self.decode_step(decode_rows) or 0.0), 0.0)
            sample = beyond_decodes / prefill_tokens
            average = self.prefill_seconds_per_token
            self.prefill_seconds_per_token = (
                sample if average is None else (1 - NEWEST_WEIGHT) * average + NEWEST_WEIGHT * sample
            )

    def decode_step(self, rows: int) -> float | None:
        """Seconds of a step of `rows` decode rows; None before any was measured."""
        if rows == 0:
            return 0.0
        if self.decode_line is None:
            return None
        base, per_row = self.decode_line
        return max(base + per_row * rows, 0.0)

    def prefill_budget(self, decode_rows: int) -> int | None:
        """Prompt tokens a step with `decode_rows` decode rows may add; None: no limit from time (no
        decodes to stall, or nothing measured yet)."""
        if decode_rows == 0:
            return None
        decode = self.decode_step(decode_rows)
        per_token = self.prefill_seconds_per_token
        if decode is None or not per_token:
            return None
        target = self.max_step_ms / 1e3 if self.max_step_ms is not None else 2 * decode
        return max(MIN_PREFILL_TOKENS, int((target - decode) / per_token))


def _line(steps: deque[tuple[int, float]]) -> tuple[float, float]:
    """(base, per row) of the least-squares line through (rows, seconds); flat where every step had the
    same rows."""
    samples = np.asarray(steps, dtype=np.float64)
    rows, seconds = samples[:, 0], samples[:, 1]
    if np.ptp(rows) == 0:
        return float(seconds.mean()), 0.0
    per_row, base = np.polyfit(rows, seconds, 1)
    return float(base), float(per_row)
