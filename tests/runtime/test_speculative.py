"""n-gram speculative decoding: the proposer, the config, greedy tokens identical with and without
speculation on the tiny model and on SmolLM2 and Qwen2.5-Coder-0.5B (alone and batched with other
requests, sampled ones included), and sampled tokens distributed as without speculation (chi-square)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig, propose_ngram

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
        ('{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}', "draft model"),
        ('{"method": "eagle"}', "not supported"),
        ('{"method": "ngram", "k": 3}', "unknown speculative config keys"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ],
)
def test_bad_configs_are_refused(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(raw)


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
    assert engine.stats.num_spec_accepted_tokens > 0  # the drafts were used, not only proposed


def test_sampled_tokens_keep_their_distribution(tiny_model) -> None:
    """The verifier's rule on a real row of logits (the tiny model's next-token logits, top-k 8): 4,000
    seeded draws with the second most likely token as the draft against 4,000 plain draws; a
    chi-square test of homogeneity must not reject at p = 0.001, and the draft is kept as often as its
    probability says (within 5 standard deviations)."""
    from scipy.stats import chi2_contingency

    from kiln.runtime.sampler import SequenceSampling, make_generator, sample
    from kiln.runtime.step_builder import SequenceSlice, build_step_inputs

    executable, _ = tiny_model
    cache = executable.kv_cache_spec.allocate(8, 4)
    logits = executable.step(build_step_inputs([SequenceSlice([5, 6, 7, 8, 9], 0, [1, 2])], 4), cache)
    params = SamplingParams(temperature=1.0, top_k=8)
    probs = torch.softmax(logits[0], -1)
    top = torch.topk(probs, 8)
    kept = top.values / top.values.sum()
    draft = int(top.indices[1])
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
    from kiln.frontend.pull import kiln_home

    path = (
        smollm2_gguf_path if model == "smollm2" else kiln_home() / "models" / model / f"{model}-q4_k_m.gguf"
    )
    if not path.is_file():
        pytest.skip(f"{model} not found at {path}; `make test` fetches it (`kiln pull {model}`)")
    outputs = {}
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}):
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
        greedy = SamplingParams(temperature=0, max_tokens=96)
        alone = [_run(llm.engine, [prompt], [greedy])["r0"] for prompt in prompts]
        batched = _run(  # with a sampled request beside them
            llm.engine,
            [*prompts, prompts[0]],
            [greedy, greedy, SamplingParams(temperature=0.8, seed=1, max_tokens=96)],
        )
        outputs[speculative is not None] = (alone, [batched["r0"], batched["r1"]])
        if speculative is not None:
            assert llm.engine.stats.num_spec_accepted_tokens > 0
    assert outputs[True] == outputs[False]
    assert outputs[False][0] == outputs[False][1]  # batching changes nothing either


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
            assert llm.engine.stats.num_spec_accepted_tokens > 0
    assert outputs[True] == outputs[False]
