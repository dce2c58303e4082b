"""Block accounting and scheduling invariants on a tiny real model: nothing leaks or is freed twice."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import SpeculativeConfig

ACTIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.integers(1, 3),  # n
            st.booleans(),  # share a prefix with earlier prompts
        ),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=30,
)


def _check_blocks(engine) -> None:
    engine.kv.pool.check_consistency(engine.kv.live_references())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    actions=ACTIONS,
    num_blocks=st.integers(12, 40),
    caching=st.booleans(),
    speculate=st.sampled_from([None, "ngram", "draft_model"]),
)
def test_random_add_step_abort_never_leaks(
    make_tiny_engine, tiny_draft_model, actions, num_blocks, caching, speculate
) -> None:
    spec = draft = None
    if speculate == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)
    elif speculate == "draft_model":
        spec = SpeculativeConfig(method="draft_model", model="tiny-draft", num_speculative_tokens=3)
        draft = tiny_draft_model
    engine = make_tiny_engine(
        num_blocks=num_blocks, enable_prefix_caching=caching, speculative=spec, draft=draft
    )
    shared = list(range(2, 30))
    added: list[str] = []
    for action in actions:
        if action[0] == "add":
            _, length, max_tokens, n, share = action
            prompt = (
                (shared + list(range(40, 90)))[:length]
                if share
                else [(7 * len(added) + i) % 90 + 2 for i in range(length)]
            )
            request_id = f"r{len(added)}"
            try:
                engine.add_request(
                    request_id, prompt, SamplingParams(max_tokens=max_tokens, n=n, temperature=0)
                )
                added.append(request_id)
            except ValueError:
                pass  # a request too big for this cache is refused up front
        elif action[0] == "step":
            for _ in range(action[1]):
                engine.step()
        elif added:
            engine.abort(added[action[1] % len(added)])
        _check_blocks(engine)
    for _ in range(2000):  # bounded: a request that never finishes fails here instead of hanging
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), {
        r: [q.status for q in v.sequences] for r, v in engine.requests.items()
    }
    _check_blocks(engine)
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_every_request_finishes_with_its_tokens(make_tiny_engine) -> None:
    engine = make_tiny_engine(num_blocks=10, max_num_batched_tokens=8)
    for i in range(6):
        engine.add_request(
            f"r{i}",
            list(range(2, 2 + 5 + 3 * i)),
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        )
    outputs = {o.request_id: o for o in engine.run_to_completion()}
    assert sorted(outputs) == [f"r{i}" for i in range(6)]
    assert all(
        len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length" for o in outputs.values()
    )
    assert engine.scheduler.num_preemptions > 0  # 10 blocks of 4 tokens cannot hold them all at once
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable


def test_null_block_is_never_handed_out(make_tiny_engine) -> None:
    engine = make_tiny_engine(num_blocks=6)
    engine.add_request("a", list(range(2, 20)), SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert 0 not in engine.kv.block_table("a#0")
    assert np.count_nonzero(engine.kv_cache[:, :, 0]) == 0  # nothing was written into the null block
