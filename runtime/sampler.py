"""Turn a batch of logits rows into tokens, one row per sequence, each row with its own settings.

Logits are host-side numpy arrays (float32 [N, vocab]; anything `np.asarray` takes is accepted) and
generators are numpy's (PCG64); the module does not import torch.

The steps run in vLLM's order: logit_bias, min_tokens, penalties (repetition, then frequency and
presence), the structured-output token mask, then greedy argmax or temperature, top-k, top-p, min-p
and a draw. Logprobs are the model's own (before any of these). Every step is a pure
function of the logits and per-row settings. A row's draw uses only that row's generator, and every
batched step works row by row, so a seeded sequence samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kiln.runtime.outputs import TokenLogprobs
from kiln.runtime.sampling_params import SamplingParams

FloatArray = npt.NDArray[np.float32]
IdArray = npt.NDArray[np.int64]

_NEG_INF = np.float32(-np.inf)
_TINY = np.finfo(np.float32).tiny
_NORMALIZER_ROWS = 32  # rows a time for the log-softmax normalizers (bounds the exp buffer)
_TOP_P_CANDIDATES = (1024, 16384)  # top-p sorts only this many most likely tokens when they hold p


@dataclass
class SequenceSampling:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    generator: np.random.Generator
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # generated so far, for penalties and min_tokens


@dataclass(frozen=True)
class SampledToken:
    """The chosen token with its raw logprob: log-softmax of the model's logits, before any processing.
    Both logprob fields are None for a row whose params ask for no logprobs."""

    token_id: int
    logprob: float | None = None
    top_logprobs: TokenLogprobs | None = None  # chosen token plus the top `params.logprobs`


def apply_token_bitmask(logits: npt.ArrayLike, bitmask: npt.ArrayLike) -> FloatArray:
    """-inf where a row's bitmask (int32 [N, ceil(vocab / 32)]) does not allow the token."""
    return _mask_tokens(_as_logits(logits), bitmask, in_place=False)


def make_generator(seed: int | None, stream: int = 0) -> np.random.Generator:
    """A PCG64 generator seeded from `seed`, or from fresh OS randomness when `seed` is None. A negative
    seed counts modulo 2**64, as torch's manual_seed takes it. `stream` > 0: another stream of the same
    seed, independent of stream 0's (a speculative draft's draws must not repeat the verifier's)."""
    if seed is None or stream == 0:
        return np.random.Generator(np.random.PCG64(None if seed is None else seed % 2**64))
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**64, stream])))


def sample(
    logits: npt.ArrayLike,
    sequences: Sequence[SequenceSampling],
    eos_token_ids: Sequence[int] = (),
    token_bitmask: npt.ArrayLike | None = None,
    drafts: Sequence[int | None] | None = None,
    draft_probs: Sequence[npt.ArrayLike | None] | None = None,
) -> list[SampledToken]:
    """One token per row of `logits` [N, vocab]; row i is sampled with `sequences[i]`'s settings.

    `eos_token_ids` are banned, with each sequence's stop_token_ids, until it has min_tokens outputs
    (unless it ignores eos). `token_bitmask` (int32 [N, ceil(vocab / 32)], xgrammar's layout: bit j of
    word w allows token 32 w + j) masks each row to the tokens its structured output allows.

    `drafts`: a speculative draft token a row (None: none), drawn from `draft_probs` q [vocab] (None:
    proposed with certainty, as an n-gram's or a greedy draft's). A sampled row keeps it with
    probability min(1, p(draft) / q(draft)), else draws from norm(max(p - q, 0)); so the token's
    distribution is p either way, and the draft is accepted when the token equals it.
    """
    logits = _check_logits(logits, len(sequences))
    params = [s.params for s in sequences]
    # the log-softmax costs an exp over the vocabulary: only for the rows that report logprobs
    with_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    maxes, log_sums = _log_normalizers(logits[with_logprobs])
    normalizer = {i: (maxes[j], log_sums[j]) for j, i in enumerate(with_logprobs)}
    # Each step copies the caller's logits only when it changes them; later steps then work in place.
    processed = _logit_bias(logits, [p.logit_bias for p in params], in_place=False)
    bans = [min_tokens_bans(s, eos_token_ids) for s in sequences]
    processed = _ban_tokens(processed, bans, in_place=processed is not logits)
    processed = _penalties(
        processed,
        [s.prompt_token_ids for s in sequences],
        [s.output_token_ids for s in sequences],
        presence_penalties=[p.presence_penalty for p in params],
        frequency_penalties=[p.frequency_penalty for p in params],
        repetition_penalties=[p.repetition_penalty for p in params],
        in_place=processed is not logits,
    )
    if token_bitmask is not None:
        processed = _mask_tokens(processed, token_bitmask, in_place=processed is not logits)
    token_ids = _choose(processed, processed is not logits, sequences, drafts, draft_probs)
    sampled = [SampledToken(token_id) for token_id in token_ids]
    for i, (row_max, log_sum) in normalizer.items():
        token_id = token_ids[i]
        top = _top_logprobs(logits[i], row_max, log_sum, token_id, params[i].logprobs or 0)
        sampled[i] = SampledToken(token_id, top[token_id], top)
    return sampled


def prompt_logprobs(
    logits: npt.ArrayLike, next_token_ids: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """For logits rows at prompt positions: the logprob of the prompt's actual next token, plus the top
    `num_top` tokens, per row."""
    logits = _check_logits(logits, len(next_token_ids))
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    _check_token_ids(next_token_ids, logits.shape[1], "next_token_ids")
    maxes, log_sums = _log_normalizers(logits)
    return [
        _top_logprobs(logits[i], maxes[i], log_sums[i], token_id, num_top)
        for i, token_id in enumerate(next_token_ids)
    ]


# --- the steps, each a pure function of the logits and per-row settings -------------------------------
# Each public step returns its input when it changes nothing, else a new array; its private twin
# with in_place=True changes the array it is given (one the caller owns) instead of copying it.


def apply_logit_bias(logits: npt.ArrayLike, biases: Sequence[Mapping[int, float] | None]) -> FloatArray:
    """Add each row's {token id: bias} to its logits."""
    return _logit_bias(_as_logits(logits), biases, in_place=False)


def min_tokens_bans(sequence: SequenceSampling, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """The token ids that must not be sampled yet: eos and stop_token_ids until min_tokens outputs."""
    params = sequence.params
    if len(sequence.output_token_ids) >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else eos_token_ids
    return sorted({*eos, *params.stop_token_ids})


def ban_tokens(logits: npt.ArrayLike, banned: Sequence[Collection[int]]) -> FloatArray:
    """Set each row's banned token ids to -inf."""
    return _ban_tokens(_as_logits(logits), banned, in_place=False)


def apply_penalties(
    logits: npt.ArrayLike,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    *,
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    repetition_penalties: Sequence[float],
) -> FloatArray:
    """Repetition penalty over prompt and output tokens (positive logits divided by it, others
    multiplied), then OpenAI's frequency (times the count) and presence penalties over output tokens."""
    return _penalties(
        _as_logits(logits),
        prompt_token_ids,
        output_token_ids,
        presence_penalties=presence_penalties,
        frequency_penalties=frequency_penalties,
        repetition_penalties=repetition_penalties,
        in_place=False,
    )


def apply_temperature(logits: npt.ArrayLike, temperatures: Sequence[float]) -> FloatArray:
    """Divide each row by its temperature (> 0)."""
    return _temperature(_as_logits(logits), temperatures, in_place=False)


def apply_top_k(logits: npt.ArrayLike, top_k: Sequence[int | None]) -> FloatArray:
    """Keep each row's k largest logits (and any tied with the k-th); None keeps all."""
    return _top_k(_as_logits(logits), top_k, in_place=False)


def apply_top_p(logits: npt.ArrayLike, top_p: Sequence[float]) -> FloatArray:
    """Keep each row's smallest set of most probable tokens whose probabilities sum to at least p (of
    tokens tied at the boundary, those with the highest ids, as a stable ascending sort leaves them)."""
    return _top_p(_as_logits(logits), top_p, in_place=False)


def apply_min_p(logits: npt.ArrayLike, min_p: Sequence[float]) -> FloatArray:
    """Drop each row's tokens whose probability is below min_p times the row's highest probability."""
    return _min_p(_as_logits(logits), min_p, in_place=False)


def apply_distribution_filters(logits: npt.ArrayLike, params: Sequence[SamplingParams]) -> FloatArray:
    """Temperature, top-k, top-p and min-p, in the order sampling applies them: the logits a sampled
    row draws from (a speculative draft draws from its own the same way)."""
    return _distribution_filters(_as_logits(logits), params, in_place=False)


def _distribution_filters(
    logits: FloatArray, params: Sequence[SamplingParams], *, in_place: bool
) -> FloatArray:
    """Each filter copies the caller's logits (in_place False) only when it changes them."""
    original = logits
    logits = _temperature(logits, [p.temperature for p in params], in_place=in_place)
    logits = _top_k(logits, [p.top_k for p in params], in_place=in_place or logits is not original)
    logits = _top_p(logits, [p.top_p for p in params], in_place=in_place or logits is not original)
    return _min_p(logits, [p.min_p for p in params], in_place=in_place or logits is not original)


def softmax(logits: npt.ArrayLike) -> FloatArray:
    """The probabilities of a logits row [vocab], float32 (computed with the row's max subtracted)."""
    row = np.asarray(logits, dtype=np.float32)
    probs = row - row.max()
    np.exp(probs, out=probs)
    probs /= probs.sum()
    return probs


def draw(logits: npt.ArrayLike, generator: np.random.Generator) -> int:
    """One token from softmax(logits) [vocab], using only `generator` (Gumbel-max on exponential noise:
    the argmax of logits - log(noise), over the finite logits only)."""
    row = np.asarray(logits, dtype=np.float32)
    finite = np.flatnonzero(row > _NEG_INF)
    subset = 0 < finite.size < row.size
    if subset:
        row = row[finite]
    noise = generator.standard_exponential(row.shape[0], dtype=np.float32)
    np.maximum(noise, _TINY, out=noise)
    np.log(noise, out=noise)
    np.subtract(row, noise, out=noise)
    best = int(np.argmax(noise))
    return int(finite[best]) if subset else best


# --- the steps' implementations ------------------------------------------------------------------------


def _logit_bias(
    logits: FloatArray, biases: Sequence[Mapping[int, float] | None], *, in_place: bool
) -> FloatArray:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            values.append(value)
    if not rows:
        return logits
    _check_token_ids(cols, logits.shape[1], "logit_bias")
    out = logits if in_place else logits.copy()
    np.add.at(out, (np.array(rows), np.array(cols)), np.array(values, dtype=np.float32))
    return out


def _ban_tokens(logits: FloatArray, banned: Sequence[Collection[int]], *, in_place: bool) -> FloatArray:
    rows = [row for row, ids in enumerate(banned) for _ in ids]
    if not rows:
        return logits
    cols = [token_id for ids in banned for token_id in ids]
    _check_token_ids(cols, logits.shape[1], "banned token ids")
    out = logits if in_place else logits.copy()
    out[np.array(rows), np.array(cols)] = _NEG_INF
    return out


def _penalties(
    logits: FloatArray,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    *,
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    repetition_penalties: Sequence[float],
    in_place: bool,
) -> FloatArray:
    rows = [
        i
        for i in range(logits.shape[0])
        if presence_penalties[i] != 0 or frequency_penalties[i] != 0 or repetition_penalties[i] != 1
    ]
    if not rows:
        return logits
    out = logits if in_place else logits.copy()
    for i in rows:
        _penalize_row(
            out[i],
            prompt_token_ids[i],
            output_token_ids[i],
            presence_penalties[i],
            frequency_penalties[i],
            repetition_penalties[i],
        )
    return out


def _penalize_row(
    row: FloatArray,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> None:
    """Penalize `row` [vocab] in place, touching only the tokens seen."""
    vocab_size = row.shape[0]
    output = _token_id_array(output_ids, vocab_size)
    if repetition != 1:
        seen = np.unique(np.concatenate([_token_id_array(prompt_ids, vocab_size), output]))
        values = row[seen]
        row[seen] = np.where(values > 0, values / repetition, values * repetition)
    if frequency != 0 or presence != 0:
        ids, counts = np.unique(output, return_counts=True)
        row[ids] = row[ids] - frequency * counts.astype(np.float32) - presence


def _mask_tokens(logits: FloatArray, bitmask: npt.ArrayLike, *, in_place: bool) -> FloatArray:
    rows, vocab = logits.shape
    words = np.ascontiguousarray(bitmask, dtype="<i4")  # little-endian, so its bytes' bits are in token order
    if words.ndim != 2 or words.shape[0] != rows or words.shape[1] * 32 < vocab:
        raise ValueError(f"token_bitmask must be int32 [{rows}, {-(-vocab // 32)}], got {words.shape}")
    banned = np.unpackbits(words.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    np.logical_not(banned, out=banned)
    out = logits if in_place else logits.copy()
    np.putmask(out, banned, _NEG_INF)
    return out


def _temperature(logits: FloatArray, temperatures: Sequence[float], *, in_place: bool) -> FloatArray:
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures must be > 0 (0 means greedy: take the argmax), got {temperatures}")
    if all(t == 1 for t in temperatures):
        return logits
    if not in_place:
        return logits / _column(temperatures)
    logits /= _column(temperatures)
    return logits


def _top_k(logits: FloatArray, top_k: Sequence[int | None], *, in_place: bool) -> FloatArray:
    vocab_size = logits.shape[1]
    ks = [vocab_size if k is None else min(k, vocab_size) for k in top_k]
    if any(k < 1 for k in ks):
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if all(k == vocab_size for k in ks):
        return logits
    kth = np.full((len(ks), 1), _NEG_INF, dtype=np.float32)
    for i, k in enumerate(ks):
        if k < vocab_size:
            kth[i, 0] = np.partition(logits[i], vocab_size - k)[vocab_size - k]
    out = logits if in_place else logits.copy()
    np.putmask(out, out < kth, _NEG_INF)
    return out


def _top_p(logits: FloatArray, top_p: Sequence[float], *, in_place: bool) -> FloatArray:
    if any(not 0 < p <= 1 for p in top_p):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if all(p == 1 for p in top_p):
        return logits
    out = logits if in_place else logits.copy()
    for i, p in enumerate(top_p):
        if p < 1:
            _top_p_row(out[i], p)
    return out


def _top_p_row(row: FloatArray, p: float) -> None:
    """Top-p on `row` [vocab] in place: sorted ascending (stably), a token goes when the tokens up to
    it hold at most 1 - p (the last one stays). Only the most likely tokens are sorted when those
    left out hold at most 1 - p (they all go), and ties straddling the cut are settled by id as a
    stable sort would, so an unstable sort gives the same set."""
    probs = softmax(row)
    limit = 1.0 - p
    vocab_size = row.shape[0]
    total = np.sum(probs, dtype=np.float64)
    candidates = np.arange(vocab_size)
    outside = 0.0  # the probability of the tokens that are not candidates
    threshold = None  # candidates are the tokens >= threshold
    for count in _TOP_P_CANDIDATES:
        if count >= vocab_size:
            break
        value = np.partition(row, vocab_size - count)[vocab_size - count]
        if value == _NEG_INF:  # fewer finite logits than count: the others have probability 0
            candidates = np.flatnonzero(row > _NEG_INF)
            break
        ids = np.flatnonzero(row >= value)
        rest = float(total - np.sum(probs[ids], dtype=np.float64))
        if rest <= limit:
            candidates, outside, threshold = ids, rest, value
            break
    order = candidates[np.argsort(row[candidates])]
    cumulative = outside + np.cumsum(probs[order], dtype=np.float64)
    cut = min(int(np.searchsorted(cumulative, limit, side="right")), order.size - 1)
    removed = order[:cut]
    if 0 < cut and row[order[cut]] == row[order[cut - 1]]:
        tie = row[order[cut]]
        below = removed[row[removed] < tie]
        tied = candidates[row[candidates] == tie]  # ascending ids: a stable sort removes these first
        removed = np.concatenate([below, tied[: cut - below.size]])
    if threshold is not None:
        np.putmask(row, row < threshold, _NEG_INF)
    row[removed] = _NEG_INF


def _min_p(logits: FloatArray, min_p: Sequence[float], *, in_place: bool) -> FloatArray:
    if any(not 0 <= p <= 1 for p in min_p):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if all(p == 0 for p in min_p):
        return logits
    # p(x) < min_p * p(max) is x - max < log(min_p): no softmax needed, and no underflow either.
    with np.errstate(divide="ignore"):
        threshold = logits.max(axis=1, keepdims=True) + np.log(_column(min_p))
    out = logits if in_place else logits.copy()
    np.putmask(out, out < threshold, _NEG_INF)
    return out


# --- helpers -------------------------------------------------------------------------------------------


def _choose(
    processed: FloatArray,
    owned: bool,
    sequences: Sequence[SequenceSampling],
    drafts: Sequence[int | None] | None = None,
    draft_probs: Sequence[npt.ArrayLike | None] | None = None,
) -> list[int]:
    """Greedy rows take the argmax (first of ties: lowest id); the others are filtered and drawn (a
    row with a draft by the rejection rule of `sample`). `owned`: `processed` may be changed."""
    chosen = [0] * len(sequences)
    rows = []
    for i, s in enumerate(sequences):
        if s.params.greedy:
            chosen[i] = int(np.argmax(processed[i]))
        else:
            rows.append(i)
    if not rows:
        return chosen
    params = [sequences[i].params for i in rows]
    filtered = processed if owned and len(rows) == len(sequences) else processed[rows]
    filtered = _distribution_filters(filtered, params, in_place=True)
    for j, i in enumerate(rows):
        draft = drafts[i] if drafts is not None else None
        generator = sequences[i].generator
        if draft is None:
            chosen[i] = draw(filtered[j], generator)
        else:
            q = draft_probs[i] if draft_probs is not None else None
            chosen[i] = _verify_draft(filtered[j], draft, q, generator)
    return chosen


def _verify_draft(
    logits: FloatArray, draft: int, q: npt.ArrayLike | None, generator: np.random.Generator
) -> int:
    """The draft with probability min(1, p(draft) / q(draft)), else a draw from norm(max(p - q, 0))."""
    p = softmax(logits)
    p_draft = float(p[draft])
    q_draft = 1.0 if q is None else float(np.asarray(q)[draft])
    keep = min(1.0, p_draft / q_draft) if q_draft > 0 else 1.0
    if generator.random() < keep:
        return draft
    if q is None:
        p[draft] = 0.0
    else:
        np.subtract(p, q, out=p)
        np.maximum(p, 0.0, out=p)
    if not float(p.sum()) > 0:
        return draft
    with np.errstate(divide="ignore"):
        return draw(np.log(p), generator)


def _log_normalizers(logits: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Each row's max and log(sum(exp(logits - max))): its log-softmax is (logits - max) - that."""
    maxes = logits.max(axis=1)
    sums = np.empty_like(maxes)
    for start in range(0, logits.shape[0], _NORMALIZER_ROWS):
        end = start + _NORMALIZER_ROWS
        shifted = logits[start:end] - maxes[start:end, None]
        np.exp(shifted, out=shifted)
        sums[start:end] = shifted.sum(axis=1)
    return maxes, np.log(sums)


def _logprobs(
    row: FloatArray, row_max: np.float32, log_sum: np.float32, token_ids: Sequence[int]
) -> FloatArray:
    return (row[list(token_ids)] - row_max) - log_sum


def _top_logprobs(
    row: FloatArray, row_max: np.float32, log_sum: np.float32, token_id: int, num_top: int
) -> TokenLogprobs:
    """The top `num_top` tokens in rank order (ties: lowest id first), then the given token if it is not
    among them."""
    ids = _top_ids(row, num_top).tolist()
    if token_id not in ids:
        ids.append(token_id)
    return dict(zip(ids, _logprobs(row, row_max, log_sum, ids).tolist(), strict=True))


def _top_ids(row: FloatArray, k: int) -> IdArray:
    vocab_size = row.shape[0]
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k < vocab_size:
        kth = np.partition(row, vocab_size - k)[vocab_size - k]
        above = np.flatnonzero(row > kth)
        ids = np.concatenate([above, np.flatnonzero(row == kth)[: k - above.size]])
    else:
        ids = np.arange(vocab_size)
    return ids[np.lexsort((ids, -row[ids]))]


def _column(values: Sequence[float]) -> FloatArray:
    return np.array(values, dtype=np.float32)[:, None]


def _as_logits(logits: npt.ArrayLike) -> FloatArray:
    return np.asarray(logits, dtype=np.float32)


def _check_logits(logits: npt.ArrayLike, num_rows: int) -> FloatArray:
    array = np.asarray(logits)
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"logits must be a floating [N, vocab] array, got {array.dtype} {array.shape}")
    if array.shape[0] != num_rows:
        raise ValueError(f"logits has {array.shape[0]} rows for {num_rows} sequences")
    return array.astype(np.float32, copy=False)


def _token_id_array(token_ids: Sequence[int], vocab_size: int) -> IdArray:
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        _check_token_ids(ids.tolist(), vocab_size, "prompt or output token ids")
    return ids


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
