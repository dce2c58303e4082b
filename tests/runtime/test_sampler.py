"""The sampler: each step against a direct implementation on fixed logits, seeds, draws and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from kiln.runtime.sampler import (
    SequenceSampling,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k,
    apply_top_p,
    ban_tokens,
    draw,
    make_generator,
    prompt_logprobs,
    sample,
)
from kiln.runtime.sampling_params import SamplingParams

VOCAB = 12
EOS = 3


def _fixed_logits(rows: int = 4, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    """Distinct values, positive and negative, so no step meets a tie or a boundary by accident."""
    return np.random.default_rng(seed).standard_normal((rows, vocab), dtype=np.float32) * 3


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


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float64, as the reference for the sampler's float32 logprobs."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _kept(row: np.ndarray) -> set[int]:
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
        np.testing.assert_array_equal(out[i, kept], logits[i, kept])


def test_top_k_keeps_ties_with_the_kth() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    assert _kept(apply_top_k(logits, [2])[0]) == {1, 2, 3}


@pytest.mark.parametrize("ps", [[0.1, 0.5, 0.9, 1.0], [0.3, 0.7, 0.95, 0.05]])
def test_top_p_matches_direct(ps: list[float]) -> None:
    logits = _fixed_logits()
    out = apply_top_p(logits, ps)
    for i, p in enumerate(ps):
        assert _kept(out[i]) == _direct_top_p(logits[i].tolist(), p)


def _stable_sort_top_p(row: np.ndarray, p: float) -> set[int]:
    """Top-p as a stable ascending sort defines it: a token goes when the tokens up to it hold at most
    1 - p, the last one staying (of tied tokens, the lowest ids go first)."""
    order = np.argsort(row, kind="stable")
    probs = np.exp(row.astype(np.float64) - row.max())
    remove = np.cumsum(probs[order] / probs.sum()) <= 1 - p
    remove[-1] = False
    return set(range(len(row))) - set(order[remove].tolist())


@pytest.mark.parametrize("scale", [8.0, 2.5, 0.3])
def test_top_p_on_a_large_vocabulary_matches_a_stable_sort(scale: float) -> None:
    """Peaked rows (a few most likely tokens hold p), flatter and flat ones (the whole row is sorted),
    and rows after top-k (only the finite logits count)."""
    logits = _fixed_logits(rows=3, vocab=20_000, seed=5) * scale
    ps = [0.5, 0.9, 0.99]
    out = apply_top_p(logits, ps)
    for i, p in enumerate(ps):
        assert _kept(out[i]) == _stable_sort_top_p(logits[i], p)
    after_top_k = apply_top_k(logits, [50, 3000, 19_000])
    out = apply_top_p(after_top_k, ps)
    for i, p in enumerate(ps):
        assert _kept(out[i]) == _stable_sort_top_p(after_top_k[i], p)


@pytest.mark.parametrize("vocab", [40, 5000])
@pytest.mark.parametrize("p", [0.2, 0.3, 0.5, 0.7, 0.95])
def test_top_p_settles_ties_at_the_cut_as_a_stable_sort(vocab: int, p: float) -> None:
    """Twelve tokens tied below the most likely one: those kept are the tied ones with the highest ids."""
    row = _fixed_logits(rows=1, vocab=vocab, seed=3)[0] / 3 - 10
    tied = np.random.default_rng(4).choice(vocab, size=13, replace=False)
    row[tied[:12]] = 5.0
    row[tied[12]] = 6.0
    kept = _kept(apply_top_p(row[None], [p])[0])
    assert kept == _stable_sort_top_p(row, p)
    kept_tied = sorted(kept & set(tied[:12].tolist()))
    assert kept_tied == sorted(tied[:12].tolist())[12 - len(kept_tied) :]


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
        np.testing.assert_allclose(out[i], expected, rtol=1.3e-6, atol=1e-5)


def test_steps_do_not_change_their_input() -> None:
    logits = _fixed_logits()
    before = logits.copy()
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
    ban_tokens(logits, [[1, 2]] * 4)
    apply_token_bitmask(logits, np.full((4, 1), 0b1010, dtype=np.int32))
    np.testing.assert_array_equal(logits, before)


@pytest.mark.parametrize("all_sampled", [True, False])
def test_sample_does_not_change_its_input(all_sampled: bool) -> None:
    logits = _fixed_logits()
    before = logits.copy()
    plain = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1)
    penalized = SamplingParams(temperature=0.7, top_p=0.8, presence_penalty=1.0, logit_bias={1: 2.0})
    for params in (plain, penalized):
        rows = [params] * 4 if all_sampled else [params, SamplingParams(temperature=0)] * 2
        sample(logits, [_seq(p, prompt=[0, 1], output=[2]) for p in rows])
        bitmask = np.full((4, 1), 0b1111_0000_1111, dtype=np.int32)
        sample(logits, [_seq(p) for p in rows], token_bitmask=bitmask)
    np.testing.assert_array_equal(logits, before)


def test_logit_bias_adds_to_each_rows_tokens() -> None:
    logits = _fixed_logits(rows=2)
    out = apply_logit_bias(logits, [{0: 5.0, 7: -100.0}, None])
    expected = logits.copy()
    expected[0, 0] += 5.0
    expected[0, 7] -= 100.0
    np.testing.assert_array_equal(out, expected)


def test_logit_bias_decides_a_greedy_token() -> None:
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 2] = 1.0
    params = SamplingParams(temperature=0, logit_bias={9: 1.5})
    assert sample(logits, [_seq(params)])[0].token_id == 9


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached() -> None:
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 1] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits, [_seq(params, output=[0])], eos_token_ids=[EOS])[0].token_id == 1
    assert sample(logits, [_seq(params, output=[0, 0])], eos_token_ids=[EOS])[0].token_id == EOS


def test_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    assert sample(logits, [_seq(params)], eos_token_ids=[EOS])[0].token_id == EOS


def test_greedy_takes_the_lowest_id_of_a_tie() -> None:
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 2.0], [5.0, 1.0, 5.0, 0.0, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=0)
    assert [t.token_id for t in sample(logits, [_seq(params), _seq(params)])] == [1, 0]


def test_greedy_takes_the_argmax_after_penalties() -> None:
    logits = np.array([[3.0, 2.0, 0.0, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [_seq(params, prompt=[0])])[0].token_id == 1


def test_temperature_divides_rows() -> None:
    logits = _fixed_logits(rows=2)
    out = apply_temperature(logits, [0.5, 2.0])
    np.testing.assert_allclose(out, logits / np.array([[0.5], [2.0]], dtype=np.float32), rtol=1e-6)
    with pytest.raises(ValueError, match="temperatures"):
        apply_temperature(logits, [0.0, 1.0])


# --- seeds and draws ------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234)
STEPS = 12


def _step_logits(step: int, rows: int, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(100 + step).standard_normal((rows, vocab), dtype=np.float32) * 2


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
    logits = np.zeros((1, 1000), dtype=np.float32)
    draws = {
        seed: [sample(logits, [s])[0].token_id for s in [_seq(seed=seed)] * 10] for seed in (1, 2, None, None)
    }
    assert len({tuple(d) for d in draws.values()}) == len(draws)


def test_make_generator_seeds_reproducibly() -> None:
    a = make_generator(42).random(5)
    np.testing.assert_array_equal(a, make_generator(42).random(5))
    assert not np.array_equal(make_generator(43).random(5), a)
    assert not np.array_equal(make_generator(None).random(5), make_generator(None).random(5))
    np.testing.assert_array_equal(make_generator(-1).random(5), make_generator(2**64 - 1).random(5))


def test_draw_is_seeded_and_takes_only_finite_logits() -> None:
    row = np.full(1000, -np.inf, dtype=np.float32)
    row[[3, 500, 999]] = [0.0, 1.0, 0.5]
    generator = make_generator(9)
    tokens = [draw(row, generator) for _ in range(300)]
    assert set(tokens) == {3, 500, 999}
    again = make_generator(9)
    assert [draw(row, again) for _ in range(300)] == tokens


def _frequencies(logits: np.ndarray, params: SamplingParams, draws: int) -> Counter[int]:
    generator = make_generator(0)
    sequences = [SequenceSampling(params, generator)] * draws
    return Counter(t.token_id for t in sample(np.broadcast_to(logits, (draws, logits.shape[1])), sequences))


def _chi_square(counts: Counter[int], probs: list[float], draws: int) -> float:
    return sum((counts[i] - draws * p) ** 2 / (draws * p) for i, p in enumerate(probs))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax(temperature: float) -> None:
    row = [1.0, 0.5, -0.3, 2.0, 0.0]
    draws = 20_000
    counts = _frequencies(np.array([row], dtype=np.float32), SamplingParams(temperature=temperature), draws)
    # Four degrees of freedom: a statistic above 25 has probability below 1e-4 for a correct sampler.
    assert _chi_square(counts, _softmax([x / temperature for x in row]), draws) < 25


def test_draws_stay_in_the_filtered_set_and_follow_it() -> None:
    row = [1.0, 0.5, -0.3, 2.0, 0.0, 1.5]
    draws = 10_000
    counts = _frequencies(np.array([row], dtype=np.float32), SamplingParams(top_k=3), draws)
    assert set(counts) == {0, 3, 5}
    kept = _softmax([row[0], row[3], row[5]])
    assert _chi_square(Counter({0: counts[0], 1: counts[3], 2: counts[5]}), kept, draws) < 20


def test_min_p_and_top_p_limit_the_draws() -> None:
    row = [3.0, 2.9, 0.0, -1.0, 2.0]
    counts = _frequencies(np.array([row], dtype=np.float32), SamplingParams(min_p=0.3), 2000)
    assert set(counts) == _direct_min_p(row, 0.3)
    counts = _frequencies(np.array([row], dtype=np.float32), SamplingParams(top_p=0.6), 2000)
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
    raw = _log_softmax(logits)
    for i, token in enumerate(sample(logits, sequences)):
        num_top = params[i].logprobs
        if num_top is None:  # no log-softmax computed for a row that reports none
            assert token.logprob is None and token.top_logprobs is None
            continue
        assert token.logprob == pytest.approx(float(raw[i, token.token_id]), abs=1e-5)
        assert token.top_logprobs is not None
        top = np.argsort(-raw[i])[:num_top].tolist()
        assert list(token.top_logprobs)[:num_top] == top  # in rank order
        assert set(token.top_logprobs) == set(top) | {token.token_id}
        for token_id, value in token.top_logprobs.items():
            assert value == pytest.approx(float(raw[i, token_id]), abs=1e-5)


def test_top_logprobs_include_a_chosen_token_outside_the_top() -> None:
    logits = np.array([[5.0, 4.0, 3.0, 0.0]], dtype=np.float32)
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={3: 10.0})
    token = sample(logits, [_seq(params)])[0]
    assert token.token_id == 3
    assert token.top_logprobs is not None
    assert list(token.top_logprobs) == [0, 3]


def test_top_logprobs_rank_ties_by_lowest_id() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]], dtype=np.float32)
    token = sample(logits, [_seq(SamplingParams(temperature=0, logprobs=2))])[0]
    assert token.token_id == 1
    assert token.top_logprobs is not None
    assert list(token.top_logprobs) == [1, 2]
    (everything,) = prompt_logprobs(logits, [0], num_top=5)
    assert list(everything) == [1, 2, 4, 3, 0]


def test_prompt_logprobs() -> None:
    logits = _fixed_logits(rows=3)
    raw = _log_softmax(logits)
    result = prompt_logprobs(logits, [4, 0, 11], num_top=2)
    for i, next_token in enumerate([4, 0, 11]):
        assert set(result[i]) == set(np.argsort(-raw[i])[:2].tolist()) | {next_token}
        assert result[i][next_token] == pytest.approx(float(raw[i, next_token]), abs=1e-5)
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


def test_a_temperature_too_small_for_float32_samples_greedily() -> None:
    logits = np.array([[0.5, 2.0, 1.0]], dtype=np.float32)
    (chosen,) = sample(logits, [SequenceSampling(SamplingParams(temperature=1e-308), make_generator(0))])
    assert chosen.token_id == 1
    with pytest.raises(ValueError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=1e-308)
