"""The sampler: each step against a direct implementation on fixed logits, seeds, draws and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from kiln.runtime.sampler import (
    SequenceSampling,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    prompt_logprobs,
    sample,
)
from kiln.runtime.sampling_params import SamplingParams

VOCAB = 12
EOS = 3


def _fixed_logits(rows: int = 4, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Distinct values, positive and negative, so no step meets a tie or a boundary by accident."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _seq(
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: int | None = 0,
) -> SequenceSampling:
    params = params or SamplingParams()
    return SequenceSampling(params, make_generator(seed), prompt, output)


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    return [e / sum(exps) for e in exps]


def _kept(row: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(row.tolist()) if x != float("-inf")}


# --- direct implementations: one token at a time, from the definitions ----------------------------------


def _direct_top_k(row: list[float], k: int | None) -> set[int]:
    if k is None:
        return set(range(len(row)))
    return {i for i, x in enumerate(row) if sum(y > x for y in row) < k}


def _direct_top_p(row: list[float], p: float) -> set[int]:
    """A token stays when the tokens more probable than it hold less than p."""
    probs = _softmax(row)
    return {i for i, q in enumerate(probs) if sum(r for r in probs if r > q) < p}


def _direct_min_p(row: list[float], min_p: float) -> set[int]:
    probs = _softmax(row)
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def _direct_penalties(
    row: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    out = []
    for token, x in enumerate(row):
        if token in prompt or token in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        x -= frequency * count + presence * (count > 0)
        out.append(x)
    return out


# --- the steps ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ks", [[None, 1, 3, 12], [5, 50, 2, None], [1, 1, 1, 1]])
def test_top_k_matches_direct(ks: list[int | None]) -> None:
    logits = _fixed_logits()
    out = apply_top_k(logits, ks)
    for i, k in enumerate(ks):
        assert _kept(out[i]) == _direct_top_k(logits[i].tolist(), k)
        kept = sorted(_kept(out[i]))
        assert torch.equal(out[i, kept], logits[i, kept])


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert _kept(apply_top_k(logits, [2])[0]) == {1, 2, 3}


@pytest.mark.parametrize("ps", [[0.1, 0.5, 0.9, 1.0], [0.3, 0.7, 0.95, 0.05]])
def test_top_p_matches_direct(ps: list[float]) -> None:
    logits = _fixed_logits()
    out = apply_top_p(logits, ps)
    for i, p in enumerate(ps):
        assert _kept(out[i]) == _direct_top_p(logits[i].tolist(), p)


@pytest.mark.parametrize("min_ps", [[0.0, 0.05, 0.2, 1.0], [0.5, 0.01, 0.1, 0.3]])
def test_min_p_matches_direct(min_ps: list[float]) -> None:
    logits = _fixed_logits()
    out = apply_min_p(logits, min_ps)
    for i, min_p in enumerate(min_ps):
        assert _kept(out[i]) == _direct_min_p(logits[i].tolist(), min_p)


PROMPTS = [[0, 1, 2, 2], [5], [], [7, 8, 9, 10, 11]]
OUTPUTS = [[4, 4, 4, 1], [5, 6, 6], [0, 11], []]


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [
        ([0.0] * 4, [0.0] * 4, [1.3, 1.0, 0.7, 2.0]),  # repetition only
        ([0.5, -1.0, 2.0, 0.0], [0.0] * 4, [1.0] * 4),  # presence only
        ([0.0] * 4, [0.4, 1.5, -0.5, 2.0], [1.0] * 4),  # frequency only
        ([0.5, 1.0, -2.0, 0.3], [0.2, -0.3, 1.0, 1.0], [1.2, 0.8, 1.5, 1.0]),  # all three
    ],
)
def test_penalties_match_direct(
    presence: list[float], frequency: list[float], repetition: list[float]
) -> None:
    logits = _fixed_logits()
    out = apply_penalties(
        logits,
        PROMPTS,
        OUTPUTS,
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
    )
    for i in range(4):
        expected = _direct_penalties(
            logits[i].tolist(), PROMPTS[i], OUTPUTS[i], presence[i], frequency[i], repetition[i]
        )
        torch.testing.assert_close(out[i], torch.tensor(expected))


def test_steps_do_not_change_their_input() -> None:
    logits = _fixed_logits()
    before = logits.clone()
    apply_top_k(logits, [2] * 4)
    apply_top_p(logits, [0.5] * 4)
    apply_min_p(logits, [0.5] * 4)
    apply_temperature(logits, [0.5] * 4)
    apply_logit_bias(logits, [{0: 5.0}] * 4)
    apply_penalties(
        logits,
        PROMPTS,
        OUTPUTS,
        presence_penalties=[1.0] * 4,
        frequency_penalties=[1.0] * 4,
        repetition_penalties=[1.5] * 4,
    )
    assert torch.equal(logits, before)


def test_logit_bias_adds_to_each_rows_tokens() -> None:
    logits = _fixed_logits(rows=2)
    out = apply_logit_bias(logits, [{0: 5.0, 7: -100.0}, None])
    expected = logits.clone()
    expected[0, 0] += 5.0
    expected[0, 7] -= 100.0
    assert torch.equal(out, expected)


def test_logit_bias_decides_a_greedy_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0
    params = SamplingParams(temperature=0, logit_bias={9: 1.5})
    assert sample(logits, [_seq(params)])[0].token_id == 9


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 1] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [_seq(params, output=[0])], eos_token_ids=[EOS])[0].token_id == 1
    assert sample(logits, [_seq(params, output=[0, 0])], eos_token_ids=[EOS])[0].token_id == EOS


def test_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sample(logits, [_seq(params)], eos_token_ids=[EOS])[0].token_id == EOS


def test_greedy_takes_the_lowest_id_of_a_tie() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [5.0, 1.0, 5.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0)
    assert [t.token_id for t in sample(logits, [_seq(params), _seq(params)])] == [1, 0]


def test_greedy_takes_the_argmax_after_penalties() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [_seq(params, prompt=[0])])[0].token_id == 1


def test_temperature_divides_rows() -> None:
    logits = _fixed_logits(rows=2)
    out = apply_temperature(logits, [0.5, 2.0])
    torch.testing.assert_close(out, logits / torch.tensor([[0.5], [2.0]]))
    with pytest.raises(ValueError, match="temperatures"):
        apply_temperature(logits, [0.0, 1.0])


# --- seeds and draws ------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234)
STEPS = 12


def _step_logits(step: int, rows: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(100 + step)) * 2


def _run(position: int, others: list[SamplingParams]) -> list[int]:
    """The SEEDED sequence's tokens over STEPS steps, at `position` among sequences with `others`."""
    params = [*others[:position], SEEDED, *others[position:]]
    sequences = [SequenceSampling(p, make_generator(p.seed)) for p in params]
    tokens = []
    for step in range(STEPS):
        logits = _step_logits(step, len(params))
        logits[position] = _step_logits(step, 1)[0]
        tokens.append(sample(logits, sequences)[position].token_id)
    return tokens


OTHERS = [
    SamplingParams(temperature=1.0),  # unseeded
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.5, seed=7, min_p=0.1),
    SamplingParams(temperature=1.2, top_k=5, presence_penalty=1.0, logprobs=3),
]


@pytest.mark.parametrize("position", range(len(OTHERS) + 1))
def test_a_seed_gives_the_same_tokens_in_any_batch(position: int) -> None:
    alone = _run(0, [])
    assert _run(position, OTHERS) == alone
    assert _run(position, OTHERS[::-1]) == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    draws = {
        seed: [sample(logits, [s])[0].token_id for s in [_seq(seed=seed)] * 10] for seed in (1, 2, None, None)
    }
    assert len({tuple(d) for d in draws.values()}) == len(draws)


def test_make_generator_seeds_reproducibly() -> None:
    a = torch.rand(5, generator=make_generator(42))
    assert torch.equal(a, torch.rand(5, generator=make_generator(42)))
    assert not torch.equal(
        torch.rand(5, generator=make_generator(None)), torch.rand(5, generator=make_generator(None))
    )


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> Counter[int]:
    generator = make_generator(0)
    sequences = [SequenceSampling(params, generator)] * draws
    return Counter(t.token_id for t in sample(logits.expand(draws, -1), sequences))


def _chi_square(counts: Counter[int], probs: list[float], draws: int) -> float:
    return sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax(temperature: float) -> None:
    row = [1.0, 0.5, -0.3, 2.0, 0.0]
    draws = 20_000
    counts = _frequencies(torch.tensor([row]), SamplingParams(temperature=temperature), draws)
    # Four degrees of freedom: a statistic above 25 has probability below 1e-4 for a correct sampler.
    assert _chi_square(counts, _softmax([x / temperature for x in row]), draws) < 25


def test_draws_stay_in_the_filtered_set_and_follow_it() -> None:
    row = [1.0, 0.5, -0.3, 2.0, 0.0, 1.5]
    draws = 10_000
    counts = _frequencies(torch.tensor([row]), SamplingParams(top_k=3), draws)
    assert set(counts) == {0, 3, 5}
    kept = _softmax([row[0], row[3], row[5]])
    assert _chi_square(Counter({0: counts[0], 1: counts[3], 2: counts[5]}), kept, draws) < 20


def test_min_p_and_top_p_limit_the_draws() -> None:
    row = [3.0, 2.9, 0.0, -1.0, 2.0]
    counts = _frequencies(torch.tensor([row]), SamplingParams(min_p=0.3), 2000)
    assert set(counts) == _direct_min_p(row, 0.3)
    counts = _frequencies(torch.tensor([row]), SamplingParams(top_p=0.6), 2000)
    assert set(counts) == _direct_top_p(row, 0.6)


# --- logprobs -------------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = _fixed_logits()
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.3, repetition_penalty=1.5, logit_bias={2: 30.0}, logprobs=0),
        SamplingParams(top_k=2, presence_penalty=2.0),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=VOCAB),
    ]
    sequences = [_seq(p, prompt=[0, 1], output=[2, 3]) for p in params]
    raw = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(sample(logits, sequences)):
        assert token.logprob == pytest.approx(float(raw[i, token.token_id]), abs=1e-6)
        num_top = params[i].logprobs
        if num_top is None:
            assert token.top_logprobs is None
            continue
        assert token.top_logprobs is not None
        top = set(raw[i].topk(num_top).indices.tolist())
        assert set(token.top_logprobs) == top | {token.token_id}
        for token_id, value in token.top_logprobs.items():
            assert value == pytest.approx(float(raw[i, token_id]), abs=1e-6)


def test_top_logprobs_include_a_chosen_token_outside_the_top() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={3: 10.0})
    token = sample(logits, [_seq(params)])[0]
    assert token.token_id == 3
    assert token.top_logprobs is not None
    assert list(token.top_logprobs) == [0, 3]


def test_prompt_logprobs() -> None:
    logits = _fixed_logits(rows=3)
    raw = torch.log_softmax(logits, dim=-1)
    result = prompt_logprobs(logits, [4, 0, 11], num_top=2)
    for i, next_token in enumerate([4, 0, 11]):
        assert set(result[i]) == set(raw[i].topk(2).indices.tolist()) | {next_token}
        assert result[i][next_token] == pytest.approx(float(raw[i, next_token]), abs=1e-6)
    assert [list(r) for r in prompt_logprobs(logits, [4, 0, 11], num_top=0)] == [[4], [0], [11]]


# --- bad input ------------------------------------------------------------------------------------------


def test_bad_input_is_refused() -> None:
    logits = _fixed_logits(rows=2)
    with pytest.raises(ValueError, match="2 rows for 1 sequences"):
        sample(logits, [_seq()])
    with pytest.raises(ValueError, match="N, vocab"):
        sample(logits[0], [_seq()])
    with pytest.raises(ValueError, match="logit_bias"):
        sample(logits[:1], [_seq(SamplingParams(logit_bias={VOCAB: 1.0}))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(logits[:1], [_seq(SamplingParams(presence_penalty=1.0), output=[VOCAB + 3])])
    with pytest.raises(ValueError, match="top_k"):
        apply_top_k(logits, [0, None])
    with pytest.raises(ValueError, match="top_p"):
        apply_top_p(logits, [0.0, 1.0])
    with pytest.raises(ValueError, match="next_token_ids"):
        prompt_logprobs(logits, [0, VOCAB], num_top=1)
