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
    _sums: _LineSums = field(default_factory=lambda: _LineSums())

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's compiled-step wall time, with what it computed."""
        if prefill_tokens == 0:
            predicted = self.decode_step(decode_rows)
            if predicted:  # one stalled step (a page fault, another process) moves the line only so far
                seconds = min(seconds, OUTLIER_FACTOR * predicted)
            if len(self.decode_steps) == WINDOW:
                self._sums.remove(*self.decode_steps[0])
            self.decode_steps.append((decode_rows, seconds))
            self._sums.add(decode_rows, seconds)
            self.decode_line = self._sums.line()
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


class _LineSums:
    """The least-squares sums of the window's (rows, seconds), kept as steps come and go: a step's
    update costs O(1) on the engine loop's critical path. Row sums are ints, so exact."""

    def __init__(self) -> None:
        self.count = self.rows = self.rows_squared = 0
        self.seconds = self.rows_seconds = 0.0

    def add(self, rows: int, seconds: float, sign: int = 1) -> None:
        self.count += sign
        self.rows += sign * rows
        self.rows_squared += sign * rows * rows
        self.seconds += sign * seconds
        self.rows_seconds += sign * rows * seconds

    def remove(self, rows: int, seconds: float) -> None:
        self.add(rows, seconds, -1)

    def line(self) -> tuple[float, float]:
        """(base, per row) of the least-squares line through the steps; flat where every step had the
        same rows."""
        spread = self.count * self.rows_squared - self.rows * self.rows
        if spread == 0:
            return self.seconds / self.count, 0.0
        per_row = (self.count * self.rows_seconds - self.rows * self.seconds) / spread
        return (self.seconds - per_row * self.rows) / self.count, per_row
