"""Turn a batch of logits rows into tokens, one row per sequence, each row with its own settings.

The steps run in vLLM's order: logit_bias, min_tokens, penalties (repetition, then frequency and
presence), the structured-output token mask, then greedy argmax or temperature, top-k, top-p, min-p
and a draw. Logprobs are the model's own (before any of these). Every step is a pure
function of the logits and per-row settings. A row's draw uses only that row's generator, and every
batched step works row by row, so a seeded sequence samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.outputs import TokenLogprobs
from kiln.runtime.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SequenceSampling:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # generated so far, for penalties and min_tokens


@dataclass(frozen=True)
class SampledToken:
    """The chosen token with its raw logprob: log-softmax of the model's logits, before any processing."""

    token_id: int
    logprob: float
    top_logprobs: TokenLogprobs | None = None  # chosen token plus the top `params.logprobs`


_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a row's bitmask does not allow the token."""
    rows, vocab = logits.shape
    allowed = ((bitmask.to(torch.int32).unsqueeze(-1) >> _BITS) & 1).bool().reshape(rows, -1)[:, :vocab]
    return logits.masked_fill(~allowed, _NEG_INF)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from `seed`, or from fresh OS randomness when `seed` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    sequences: Sequence[SequenceSampling],
    eos_token_ids: Sequence[int] = (),
    token_bitmask: torch.Tensor | None = None,
    drafts: Sequence[int | None] | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
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
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    params = [s.params for s in sequences]
    processed = apply_logit_bias(logits, [p.logit_bias for p in params])
    processed = ban_tokens(processed, [min_tokens_bans(s, eos_token_ids) for s in sequences])
    processed = apply_penalties(
        processed,
        [s.prompt_token_ids for s in sequences],
        [s.output_token_ids for s in sequences],
        presence_penalties=[p.presence_penalty for p in params],
        frequency_penalties=[p.frequency_penalty for p in params],
        repetition_penalties=[p.repetition_penalty for p in params],
    )
    if token_bitmask is not None:
        processed = apply_token_bitmask(processed, token_bitmask)
    token_ids = _choose(processed, sequences, drafts, draft_probs)
    chosen = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
    logprobs = raw_logprobs.gather(1, chosen).squeeze(1).tolist()
    return [
        SampledToken(token_id, logprob, _top_logprobs_if(raw_logprobs[i], token_id, params[i].logprobs))
        for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True))
    ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """For logits rows at prompt positions: the logprob of the prompt's actual next token, plus the top
    `num_top` tokens, per row."""
    logits = _check_logits(logits, len(next_token_ids))
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    _check_token_ids(next_token_ids, logits.shape[1], "next_token_ids")
    logprobs = torch.log_softmax(logits, dim=-1)
    return [_top_logprobs(logprobs[i], token_id, num_top) for i, token_id in enumerate(next_token_ids)]


# --- the steps, each a pure function of the logits and per-row settings -------------------------------


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> torch.Tensor:
    """Add each row's {token id: bias} to its logits."""
    rows, cols, values = [], [], []
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            values.append(value)
    if not rows:
        return logits
    _check_token_ids(cols, logits.shape[1], "logit_bias")
    out = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    out.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return out


def min_tokens_bans(sequence: SequenceSampling, eos_token_ids: Sequence[int] = ()) -> list[int]:
    """The token ids that must not be sampled yet: eos and stop_token_ids until min_tokens outputs."""
    params = sequence.params
    if len(sequence.output_token_ids) >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else eos_token_ids
    return sorted({*eos, *params.stop_token_ids})


def ban_tokens(logits: torch.Tensor, banned: Sequence[Collection[int]]) -> torch.Tensor:
    """Set each row's banned token ids to -inf."""
    rows = [row for row, ids in enumerate(banned) for _ in ids]
    if not rows:
        return logits
    cols = [token_id for ids in banned for token_id in ids]
    _check_token_ids(cols, logits.shape[1], "banned token ids")
    out = logits.clone()
    out[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF
    return out


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    *,
    presence_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    repetition_penalties: Sequence[float],
) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (positive logits divided by it, others
    multiplied), then OpenAI's frequency (times the count) and presence penalties over output tokens."""
    rows = [
        i
        for i in range(logits.shape[0])
        if presence_penalties[i] != 0 or frequency_penalties[i] != 0 or repetition_penalties[i] != 1
    ]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        out[i] = _penalize_row(
            out[i],
            prompt_token_ids[i],
            output_token_ids[i],
            presence_penalties[i],
            frequency_penalties[i],
            repetition_penalties[i],
        )
    return out


def apply_temperature(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """Divide each row by its temperature (> 0)."""
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures must be > 0 (0 means greedy: take the argmax), got {temperatures}")
    if all(t == 1 for t in temperatures):
        return logits
    return logits / _column(temperatures, logits)


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int | None]) -> torch.Tensor:
    """Keep each row's k largest logits (and any tied with the k-th); None keeps all."""
    vocab_size = logits.shape[1]
    ks = [vocab_size if k is None else min(k, vocab_size) for k in top_k]
    if any(k < 1 for k in ks):
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    if all(k == vocab_size for k in ks):
        return logits
    largest = logits.topk(max(ks), dim=-1).values
    kth = largest.gather(1, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Keep each row's smallest set of most probable tokens whose probabilities sum to at least p."""
    if any(not 0 < p <= 1 for p in top_p):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if all(p == 1 for p in top_p):
        return logits
    ascending, order = logits.sort(dim=-1, stable=True)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # A token goes when the tokens below it hold at most 1 - p, i.e. those above it already reach p.
    limit = _column([1 - p if p < 1 else -1.0 for p in top_p], logits)
    remove_sorted = cumulative <= limit
    remove_sorted[:, -1] = False
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop each row's tokens whose probability is below min_p times the row's highest probability."""
    if any(not 0 <= p <= 1 for p in min_p):
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if all(p == 0 for p in min_p):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * _column(min_p, logits)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def draw(logits: torch.Tensor, generator: torch.Generator) -> int:
    """One token from softmax(logits) [vocab], using only `generator` (Gumbel-max on exponential noise)."""
    noise = torch.empty(logits.shape[0], device=generator.device).exponential_(generator=generator)
    noise = noise.to(logits.device).clamp_min(torch.finfo(noise.dtype).tiny)
    return int(torch.argmax(logits - noise.log()))


# --- helpers -------------------------------------------------------------------------------------------


def _choose(
    processed: torch.Tensor,
    sequences: Sequence[SequenceSampling],
    drafts: Sequence[int | None] | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[int]:
    """Greedy rows take the argmax (first of ties: lowest id); the others are filtered and drawn (a
    row with a draft by the rejection rule of `sample`)."""
    chosen = torch.argmax(processed, dim=-1).tolist()
    rows = [i for i, s in enumerate(sequences) if not s.params.greedy]
    if not rows:
        return chosen
    params = [sequences[i].params for i in rows]
    filtered = apply_temperature(processed[rows], [p.temperature for p in params])
    filtered = apply_top_k(filtered, [p.top_k for p in params])
    filtered = apply_top_p(filtered, [p.top_p for p in params])
    filtered = apply_min_p(filtered, [p.min_p for p in params])
    for j, i in enumerate(rows):
        draft = drafts[i] if drafts is not None else None
        generator = sequences[i].generator
        if draft is None:
            chosen[i] = draw(filtered[j], generator)
            continue
        p = torch.softmax(filtered[j], dim=-1)
        q = draft_probs[i] if draft_probs is not None else None
        keep = p[draft] if q is None else torch.clamp(p[draft] / q[draft], max=1.0)
        if float(torch.rand((), generator=generator, device=generator.device)) < float(keep):
            chosen[i] = draft
            continue
        residual = p.clone() if q is None else torch.clamp(p - q.to(p), min=0.0)
        if q is None:
            residual[draft] = 0.0
        chosen[i] = draw(residual.log(), generator) if float(residual.sum()) > 0 else draft
    return chosen


def _penalize_row(
    logits: torch.Tensor,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:
    vocab_size = logits.shape[0]
    output_counts = _counts(output_ids, vocab_size, logits.device)
    if repetition != 1:
        seen = (output_counts + _counts(prompt_ids, vocab_size, logits.device)) > 0
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0).to(logits.dtype)


def _counts(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        _check_token_ids(ids.tolist(), vocab_size, "prompt or output token ids")
    return torch.bincount(ids, minlength=vocab_size).to(torch.float32)


def _top_logprobs_if(logprobs: torch.Tensor, token_id: int, num_top: int | None) -> TokenLogprobs | None:
    return None if num_top is None else _top_logprobs(logprobs, token_id, num_top)


def _top_logprobs(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """The top `num_top` tokens in rank order, then the given token if it is not among them."""
    values, ids = logprobs.topk(num_top)
    top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    top.setdefault(token_id, float(logprobs[token_id]))
    return top


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _check_logits(logits: torch.Tensor, num_rows: int) -> torch.Tensor:
    if logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape)
        raise ValueError(f"logits must be a floating [N, vocab] tensor, got {logits.dtype} {shape}")
    if logits.shape[0] != num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows for {num_rows} sequences")
    return logits.float()


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what}: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
