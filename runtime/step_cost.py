"""How long a step takes, learned from the steps this engine has run, and how many prompt tokens a step
may add to the running decodes without stalling them.

A step that mixes `rows` decoding sequences with `p` prompt tokens takes about decode(rows) + p x
prefill_per_token. Both are measured as the engine runs (exponential moving averages of the compiled
step's wall time), so nothing is probed at start-up and the estimate follows the machine's load:
- decode(rows): steps of decode rows only, kept per row count;
- prefill_per_token: steps with at least `MIN_PREFILL_SAMPLE` prompt tokens, their time beyond the
  decode rows' estimate divided by their prompt tokens.

The step's time target is `max_step_ms` when given, else twice the decode rows' own step: a prompt may
take as much of a step as the decodes do, so a decoding stream's next token waits at most about twice
its undisturbed gap. At least `MIN_PREFILL_TOKENS` prompt tokens go into every step, so a prompt always
progresses, however cheap the decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_PREFILL_SAMPLE = 16  # a step with fewer prompt tokens says too little about their cost
MIN_PREFILL_TOKENS = 16  # one KV block: the least prompt a step with decodes computes
SMOOTHING = 0.2  # weight of the newest step in each moving average


@dataclass
class StepCostModel:
    max_step_ms: float | None = None  # None: twice the decode rows' own step
    decode_seconds: dict[int, float] = field(default_factory=dict)  # decode rows -> step seconds
    prefill_seconds_per_token: float | None = None

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One step's compiled-step wall time, with what it computed."""
        if prefill_tokens == 0:
            self.decode_seconds[decode_rows] = _smooth(self.decode_seconds.get(decode_rows), seconds)
        elif prefill_tokens >= MIN_PREFILL_SAMPLE:
            beyond_decodes = max(seconds - (self.decode_step(decode_rows) or 0.0), 0.0)
            self.prefill_seconds_per_token = _smooth(
                self.prefill_seconds_per_token, beyond_decodes / prefill_tokens
            )

    def decode_step(self, rows: int) -> float | None:
        """Seconds of a step of `rows` decode rows: measured for that many rows, else for the nearest
        count below it (a step of more rows costs at least as much), else the nearest above."""
        if rows == 0:
            return 0.0
        if rows in self.decode_seconds:
            return self.decode_seconds[rows]
        below = [count for count in self.decode_seconds if count < rows]
        if below:
            return self.decode_seconds[max(below)]
        above = [count for count in self.decode_seconds if count > rows]
        return self.decode_seconds[min(above)] if above else None

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


def _smooth(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - SMOOTHING) * average + SMOOTHING * sample
