"""LoRA adapters end to end through `kiln.LLM`: tiny random-weight Llama and Qwen2 models with random PEFT
adapters, against transformers + peft on the same weights (float32), on the reference and TVM backends;
llama.cpp's GGUFs of the same adapters give the same tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import kiln
from tests.conftest import TinyLoRAModel

PROMPTS = [[5, 17, 42, 99, 3, 7, 11], [200, 1, 9, 33, 70, 14, 2, 8, 150]]
NEW_TOKENS = 8
TOLERANCE = {"reference": 1e-5, "tvm": 1e-4}  # on each generated token's logprob


def _llm(model: TinyLoRAModel, backend: str, **options: Any) -> kiln.LLM:
    extra = (
        {"kv_cache_dtype": "f32", "lora_dtype": "f32"} if backend == "tvm" else {}
    )  # TVM CPU: f16 by default
    return kiln.LLM(
        str(model.base),
        backend=backend,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=3,
        show_progress=False,
        **extra,
        **options,
    )


def _requests(paths: dict[str, Any], suffix: str = "") -> list[kiln.LoRARequest | None]:
    return [None] + [
        kiln.LoRARequest(name + suffix, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())
    ]


def _reference_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """transformers' log-softmax at each generated position, [tokens, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[
            0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)
        ]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize("backend", ["reference", "tvm"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_adapters_match_transformers_peft(
    kind: str, backend: str, tiny_lora_models: dict[str, TinyLoRAModel]
) -> None:
    """Every prompt under every adapter and the base model in one batch: greedy tokens and their logprobs
    as transformers + peft's; the GGUF adapters give the same tokens."""
    model = tiny_lora_models[kind]
    llm = _llm(model, backend)
    requests = _requests(model.adapters)
    params = kiln.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0, ignore_eos=True)
    batch = [(prompt, request) for prompt in PROMPTS for request in requests]
    outputs = llm.generate([p for p, _ in batch], params, lora_request=[r for _, r in batch])
    distinct = {tuple(o.outputs[0].token_ids) for o in outputs}
    assert len(distinct) > len(PROMPTS) * 2, "the adapters should change the tokens"
    for (prompt, request), output in zip(batch, outputs, strict=True):
        completion = output.outputs[0]
        reference = _reference_logprobs(
            model.peft_model(request and request.lora_name), prompt, completion.token_ids
        )
        assert completion.token_ids == reference.argmax(-1).tolist(), (request, prompt)
        got = [step[token] for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        expected = reference[np.arange(len(got)), completion.token_ids]
        np.testing.assert_allclose(got, expected, atol=TOLERANCE[backend])
    # llama.cpp's converter writes lora_alpha but not use_rslora (llama.cpp scales by alpha / rank): the
    # rsLoRA adapter's GGUF is another adapter
    ggufs = _requests({name: path for name, path in model.gguf_adapters.items() if name != "rs8"}, "-gguf")
    same = [(prompt, index) for prompt in PROMPTS for index in range(len(ggufs))]
    from_gguf = llm.generate([p for p, _ in same], params, lora_request=[ggufs[i] for _, i in same])
    kept = [
        o.outputs[0].token_ids
        for (_, r), o in zip(batch, outputs, strict=True)
        if r is None or r.lora_name != "rs8"
    ]
    assert [o.outputs[0].token_ids for o in from_gguf] == kept


@pytest.mark.slow
def test_smollm2_with_a_random_rank_16_adapter_matches_transformers_peft(
    smollm2_gguf_path: Any, smollm2_hf: Any, tmp_path: Any, llama_cpp_source: Any
) -> None:
    """The real SmolLM2 GGUF (its Q4_1 blocks) on the default path (TVM for this CPU) with a random rank-16
    adapter on every linear: 16 greedy tokens as transformers + peft on the dequantized weights, from the
    PEFT folder and from llama.cpp's GGUF of it."""
    import copy
    import subprocess
    import sys

    import peft

    script = [
        sys.executable,
        "scripts/make_lora.py",
        str(smollm2_gguf_path),
        str(tmp_path),
        "--gguf",
        str(llama_cpp_source),
    ]
    subprocess.run(script, check=True, capture_output=True)
    adapter, adapter_gguf = tmp_path / "lora-0", tmp_path / "lora-0.gguf"
    reference = peft.PeftModel.from_pretrained(
        copy.deepcopy(smollm2_hf), adapter
    ).eval()  # the fixture unchanged
    llm = kiln.LLM(str(smollm2_gguf_path), enable_lora=True, max_lora_rank=16, show_progress=False)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    params = kiln.SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True)
    requests = [
        kiln.LoRARequest("peft", 1, str(adapter)),
        kiln.LoRARequest("gguf", 2, str(adapter_gguf)),
        None,
    ]
    jobs = [(prompt, request) for prompt in prompts for request in requests]
    outputs = llm.generate([p for p, _ in jobs], params, lora_request=[r for _, r in jobs])
    for (prompt, request), output in zip(jobs, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        expected = _reference_logprobs(reference if request is not None else smollm2_hf, prompt, tokens)
        assert tokens == expected.argmax(-1).tolist(), request
    with_adapter = [o.outputs[0].token_ids for (_, r), o in zip(jobs, outputs, strict=True) if r is not None]
    assert with_adapter[0] == with_adapter[1] and with_adapter[2] == with_adapter[3]
    assert outputs[0].outputs[0].token_ids != outputs[2].outputs[0].token_ids  # the adapter changes them


def test_an_artifact_compiled_with_lora_serves_adapters_without_the_flag(
    tiny_lora_models: dict[str, TinyLoRAModel],
) -> None:
    model = tiny_lora_models["llama"]
    compiled = kiln.LLM(str(model.base), backend="reference", enable_lora=True, show_progress=False)
    folder = kiln.LLM(str(compiled.artifact.path), show_progress=False)
    assert folder.serves_lora
    request = kiln.LoRARequest("r4", 1, str(model.adapters["r4"]))
    params = kiln.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in folder.generate([PROMPTS[0]], params, lora_request=request)] == [
        o.outputs[0].token_ids for o in compiled.generate([PROMPTS[0]], params, lora_request=request)
    ]
    assert not kiln.LLM(str(model.base), backend="reference", show_progress=False).serves_lora
