"""Speculative decoding, n-gram and draft model: the proposers, the config, greedy tokens identical with
and without speculation on the tiny model and on SmolLM2 and Qwen2.5-Coder-0.5B (alone and batched with
other requests, sampled ones included), and sampled tokens distributed as without speculation
(chi-square, for drafts proposed with certainty and for drafts drawn from a draft distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from kiln.runtime.speculative.ngram import propose_ngram

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=1)


def test_the_longest_latest_match_proposes() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(tokens, NGRAM, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert propose_ngram([4, 5, 6], NGRAM, 3) == []  # no earlier occurrence
    assert propose_ngram(tokens, NGRAM, 1) == [7]
    assert propose_ngram([5, 5, 5, 5], NGRAM, 3) == [5]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"method": "draft_model"}', "does not fit"),
        ('{"method": "ngram", "model": "smollm2"}', "does not fit"),
        ('{"method": "eagle"}', "not supported"),
        ('{"method": "ngram", "k": 3}', "unknown speculative config keys"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ],
)
def test_bad_configs_are_refused(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(raw)


def test_a_named_model_means_a_draft_model() -> None:
    config = SpeculativeConfig.parse('{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}')
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "qwen2.5-coder-0.5b-instruct",
        4,
    )


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    return {o.request_id: o.outputs[0].token_ids for o in engine.run_to_completion()}


def test_tiny_model_greedy_tokens_are_identical(make_tiny_engine) -> None:
    prompts = [[(3 * i + j) % 40 + 2 for j in range(5 + 3 * i)] * 2 for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    params = [greedy, greedy, sampled, greedy, sampled, greedy]
    plain = _run(make_tiny_engine(), prompts, params)
    engine = make_tiny_engine(speculative=NGRAM)
    speculated = _run(engine, prompts, params)
    greedy_ids = [f"r{i}" for i, p in enumerate(params) if p.greedy]
    assert [speculated[r] for r in greedy_ids] == [plain[r] for r in greedy_ids]
    assert engine.stats.speculative.num_accepted_tokens > 0  # the drafts were used, not only proposed


DRAFT = SpeculativeConfig(method="draft_model", model="tiny-draft", num_speculative_tokens=3)


def test_tiny_draft_model_greedy_tokens_are_identical(make_tiny_engine, tiny_model, tiny_draft_model) -> None:
    """A noisy draft (some drafts rejected) and the tiny model drafting for itself (every draft accepted:
    the draft's own cache is right, also for request ids used again), batched with sampled requests, and
    in a cache small enough to preempt."""
    prompts = [[(3 * i + j) % 40 + 2 for j in range(5 + 3 * i)] * 2 for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    params = [greedy, greedy, sampled, greedy, sampled, greedy]
    greedy_ids = [f"r{i}" for i, p in enumerate(params) if p.greedy]
    for num_blocks in (64, 24):
        plain = _run(make_tiny_engine(num_blocks=num_blocks), prompts, params)
        noisy = make_tiny_engine(num_blocks=num_blocks, speculative=DRAFT, draft=tiny_draft_model)
        drafted = _run(noisy, prompts, params)
        assert [drafted[r] for r in greedy_ids] == [plain[r] for r in greedy_ids]
        stats = noisy.stats.speculative
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        if num_blocks == 24:
            assert noisy.scheduler.num_preemptions > 0
        itself = make_tiny_engine(num_blocks=num_blocks, speculative=DRAFT, draft=tiny_model[0])
        only_greedy = [p for p, q in zip(prompts, params, strict=True) if q.greedy]
        for _ in range(2):  # the second time with the same request ids, and prefix-cache hits
            mirrored = _run(itself, only_greedy, [greedy] * len(only_greedy))
            assert sorted(mirrored.values()) == sorted(plain[r] for r in greedy_ids)
        if num_blocks == 64:
            assert itself.stats.speculative.num_accepted_tokens == itself.stats.speculative.num_draft_tokens


def test_draft_model_sampling_keeps_the_targets_distribution(make_tiny_engine, tiny_model) -> None:
    """Through the engine: 3-token continuations (temperature 1, top-k 4) drafted by another model (the
    target's weights plus noise), and without speculation, against the target's exact joint
    distribution of the 64 continuations (21 steps of the target enumerate them): a chi-square
    goodness-of-fit test must not reject at p = 0.001 for either, and drafts must be kept sometimes
    and rejected sometimes (both paths of the rule ran)."""
    from scipy.stats import chisquare

    from kiln.backends.reference import ReferenceExecutable
    from kiln.ir.step import SequenceSlice, build_step_inputs
    from kiln.runtime.sampler import softmax

    executable, _ = tiny_model
    generator = torch.Generator().manual_seed(11)
    noisy = {
        name: w + 0.3 * w.std() * torch.randn(w.shape, generator=generator)
        for name, w in executable.weights.items()
    }
    draft = ReferenceExecutable(executable.graph, noisy)
    prompt, top_k, length = [5, 9, 14, 3, 27, 8], 4, 3

    def next_tokens(prefix: list[int]) -> dict[int, float]:
        cache = executable.kv_cache_spec.allocate(8, 4)
        logits = executable.step(build_step_inputs([SequenceSlice(prefix, 0, [1, 2, 3, 4])], 4), cache)[0]
        top = np.argsort(-logits, kind="stable")[:top_k]
        return dict(zip(top.tolist(), softmax(logits[top]).tolist(), strict=True))

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        exact = {
            (*seq, token): prob * p
            for seq, prob in exact.items()
            for token, p in next_tokens(prompt + list(seq)).items()
        }
    outcomes = sorted(exact)
    samples, per_request = 3200, 16
    for speculative in (None, DRAFT):
        engine = make_tiny_engine(speculative=speculative, draft=draft if speculative else None)
        for i in range(samples // per_request):
            seed = per_request * i + (samples if speculative else 0)
            params = SamplingParams(
                n=per_request, temperature=1.0, top_k=top_k, seed=seed, max_tokens=length, ignore_eos=True
            )
            engine.add_request(f"r{i}", prompt, params)
        tally = dict.fromkeys(outcomes, 0)
        for request in engine.run_to_completion():
            for output in request.outputs:
                tally[tuple(output.token_ids)] += 1  # a continuation outside the top-k would fail here
        observed = [tally[o] for o in outcomes]
        total = sum(exact.values())  # 1 up to float32 rounding, which chisquare would refuse
        expected = [samples * exact[o] / total for o in outcomes]
        assert chisquare(observed, expected).pvalue > 0.001, (speculative, observed, expected)
        if speculative is not None:
            stats = engine.stats.speculative
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_prompts_last_token_may_speculate(make_tiny_engine, tiny_draft_model) -> None:
    """A chunked prompt leaves its last token for a step of its own, which drafts: the first token is
    then sampled by the verifier, and an n > 1 request's other samples must still be admitted."""
    engine = make_tiny_engine(max_num_batched_tokens=8, speculative=DRAFT, draft=tiny_draft_model)
    engine.add_request("r", list(range(2, 11)), SamplingParams(n=2, max_tokens=5, temperature=0))
    outputs = []
    for _ in range(100):
        outputs += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert [len(c.token_ids) for c in outputs[0].outputs] == [5, 5]
    assert engine.stats.speculative.num_drafts > 0


def test_a_draft_executable_needs_the_draft_method(make_tiny_engine, tiny_draft_model) -> None:
    with pytest.raises(ValueError, match="draft executable"):
        make_tiny_engine(speculative=NGRAM, draft=tiny_draft_model)
    with pytest.raises(ValueError, match="draft executable"):
        make_tiny_engine(speculative=DRAFT)


def test_drafts_drawn_from_q_keep_the_distribution() -> None:
    """The rejection rule with a draft distribution q far from p: 6,000 seeded rounds of "draw the draft
    from q, then verify" against 6,000 plain draws from p; a chi-square test of homogeneity must not
    reject at p = 0.001, and the draft is kept at the rate sum(min(p, q)) (within 5 standard deviations)."""
    from scipy.stats import chi2_contingency

    from kiln.runtime.sampler import SequenceSampling, draw, make_generator, sample, softmax

    logits = np.array([[2.0, 1.5, 0.5, 0.0, -1.0, -3.0]], dtype=np.float32)
    draft_logits = np.array([0.0, 2.0, 1.0, 1.5, -1.0, 0.5], dtype=np.float32)
    q = softmax(draft_logits)
    p = softmax(logits[0])
    params = SamplingParams(temperature=1.0)
    draws = 6000
    plain: dict[int, int] = {}
    verified: dict[int, int] = {}
    kept = 0
    for seed in range(draws):
        (token,) = sample(logits, [SequenceSampling(params, make_generator(seed))])
        plain[token.token_id] = plain.get(token.token_id, 0) + 1
        draft = draw(draft_logits, make_generator(draws + seed))
        rows = [SequenceSampling(params, make_generator(2 * draws + seed))]
        (token,) = sample(logits, rows, drafts=[draft], draft_probs=[q])
        verified[token.token_id] = verified.get(token.token_id, 0) + 1
        kept += token.token_id == draft
    tokens = sorted(set(plain) | set(verified))
    assert chi2_contingency([[t.get(k, 0) for k in tokens] for t in (plain, verified)]).pvalue > 0.001
    rate = float(np.minimum(p, q).sum())
    assert abs(kept - draws * rate) < 5 * (draws * rate * (1 - rate)) ** 0.5


def test_sampled_tokens_keep_their_distribution(tiny_model) -> None:
    """The verifier's rule on a real row of logits (the tiny model's next-token logits, top-k 8): 4,000
    seeded draws with the second most likely token as the draft against 4,000 plain draws; a
    chi-square test of homogeneity must not reject at p = 0.001, and the draft is kept as often as its
    probability says (within 5 standard deviations)."""
    from scipy.stats import chi2_contingency

    from kiln.ir.step import SequenceSlice, build_step_inputs
    from kiln.runtime.sampler import SequenceSampling, make_generator, sample, softmax

    executable, _ = tiny_model
    cache = executable.kv_cache_spec.allocate(8, 4)
    step = executable.step(build_step_inputs([SequenceSlice([5, 6, 7, 8, 9], 0, [1, 2])], 4), cache)
    logits = np.asarray(step, dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=8)
    probs = softmax(logits[0])
    top = np.argsort(-probs, kind="stable")[:8]
    kept = probs[top] / probs[top].sum()
    draft = int(top[1])
    draws = 4000
    tallies = []
    for drafts in (None, [draft]):
        tally: dict[int, int] = {}
        for seed in range(draws):
            rows = [SequenceSampling(params, make_generator(seed + (draws if drafts else 0)))]
            (token,) = sample(logits, rows, drafts=drafts)
            tally[token.token_id] = tally.get(token.token_id, 0) + 1
        tallies.append(tally)
    tokens = sorted(set(tallies[0]) | set(tallies[1]))
    assert chi2_contingency([[t.get(k, 0) for k in tokens] for t in tallies]).pvalue > 0.001
    p_draft = float(kept[1])
    spread = 5 * (draws * p_draft * (1 - p_draft)) ** 0.5
    assert abs(tallies[1].get(draft, 0) - draws * p_draft) < spread


CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def main():
    for i in range(10):
        print(i, fibonacci(i))
'''
TASKS = [
    f"Rewrite this code so that the function fibonacci is named fib, changing nothing else:\n\n{CODE}",
    "Quote the passage word for word, then say how many words it has.\n\nPassage: The quick brown fox jumps "
    "over the lazy dog. The dog does not move. The fox jumps again.",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "qwen2.5-coder-0.5b-instruct"])
def test_real_models_greedy_tokens_are_identical(model: str, smollm2_gguf_path) -> None:
    """Plain, n-gram and (on SmolLM2) draft-model decoding make the same greedy tokens, alone and
    batched. The draft is the model itself (compiled once, loaded twice: a second executable with its
    own cache), so every draft must be accepted: any slip in the draft's cache bookkeeping would show as
    rejections. Qwen checks verification on K-quant kernels, not the draft's bookkeeping again (a second
    0.5B model doubles its cost), and that a draft with another vocabulary is refused."""
    from kiln.frontend.pull import kiln_home
    from kiln.llm import OptionsError

    path = (
        smollm2_gguf_path if model == "smollm2" else kiln_home() / "models" / model / f"{model}-q4_k_m.gguf"
    )
    if not path.is_file():
        pytest.skip(f"{model} not found at {path}; `make test` fetches it (`kiln pull {model}`)")
    methods = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    }
    if model == "smollm2":
        methods["draft_model"] = {"model": str(path), "num_speculative_tokens": 3}
    outputs = {}
    for method, speculative in methods.items():
        llm = kiln.LLM(str(path), max_num_seqs=4, speculative_config=speculative, show_progress=False)
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": task}], add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for task in TASKS
        ]
        greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # no drafts cut short
        alone = [_run(llm.engine, [prompt], [greedy])["r0"] for prompt in prompts]
        stats = llm.engine.stats.speculative
        if method == "ngram":
            assert stats.num_accepted_tokens > 0
        if method == "draft_model":  # greedy drafts of the model itself
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        batched = _run(  # with a sampled request beside them
            llm.engine,
            [*prompts, prompts[0]],
            [greedy, greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=96)],
        )
        outputs[method] = (alone, [batched["r0"], batched["r1"]])
    assert all(tokens == outputs["plain"] for tokens in outputs.values())
    assert outputs["plain"][0] == outputs["plain"][1]  # batching changes nothing either
    if model != "smollm2":
        with pytest.raises(OptionsError, match=r"49,152 tokens.*151,936"):
            kiln.LLM(str(path), speculative_config={"model": str(smollm2_gguf_path)}, show_progress=False)


@pytest.mark.slow
def test_constrained_requests_speculate_and_keep_their_tokens(smollm2_gguf_path) -> None:
    """A JSON schema and a regex, greedy, on SmolLM2: each verified row is masked by the matcher as it
    stands after the tokens before it, so the tokens are those of plain constrained decoding."""
    item = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id"],
        "additionalProperties": False,
    }
    schema = {"type": "array", "items": item, "minItems": 8, "maxItems": 8}
    constraints = [kiln.StructuredOutput.json_schema(schema), kiln.StructuredOutput("regex", "(ab ){10}ab")]
    outputs = {}
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}):
        llm = kiln.LLM(
            str(smollm2_gguf_path), max_num_seqs=2, speculative_config=speculative, show_progress=False
        )
        params = [SamplingParams(temperature=0, max_tokens=200, structured_output=c) for c in constraints]
        results = llm.generate(["List eight ids as JSON:", "Repeat ab:"], params)
        outputs[speculative is not None] = [r.outputs[0].token_ids for r in results]
        if speculative is not None:
            assert llm.engine.stats.speculative.num_accepted_tokens > 0
    assert outputs[True] == outputs[False]
