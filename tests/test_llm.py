"""The offline API in vLLM's shape, on SmolLM2."""

from __future__ import annotations

import pytest

import kiln


@pytest.mark.slow
def test_llm_generate_keeps_the_prompt_order(smollm2_gguf_path) -> None:
    llm = kiln.LLM(str(smollm2_gguf_path), num_blocks=128)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
    params = kiln.SamplingParams(temperature=0, max_tokens=6)
    outputs = llm.generate(prompts, params)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and 1 <= len(o.outputs[0].token_ids) <= 6 for o in outputs)
    assert "Paris" in outputs[0].outputs[0].text
    assert outputs[1].outputs[0].text.strip().startswith("5")
    one = llm.generate(prompts[1], params)[0]
    assert one.outputs[0].token_ids == outputs[1].outputs[0].token_ids
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert "Paris" in reply.outputs[0].text
    with pytest.raises(ValueError, match="sampling params for 3 prompts"):
        llm.generate(prompts, [params])
    as_dicts = llm.generate([{"prompt": prompts[1]}, {"prompt_token_ids": one.prompt_token_ids}], params)
    assert all(o.outputs[0].token_ids == one.outputs[0].token_ids for o in as_dicts)
    parts = [{"type": "text", "text": "What is the capital of France?"}]
    assert llm.chat([{"role": "user", "content": parts}], params).outputs[0].text == reply.outputs[0].text
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] is an image.*text only"):
        llm.chat([{"role": "user", "content": [*parts, image]}], params)
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]: this model takes text only"):
        llm.generate({"prompt": "What is this?", "multi_modal_data": {"image": object()}}, params)
    with pytest.raises(ValueError, match="exactly one of prompt and prompt_token_ids"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]}, params)


@pytest.mark.slow
def test_structured_output_offline(smollm2_gguf_path) -> None:
    llm = kiln.LLM(str(smollm2_gguf_path), num_blocks=128)
    choice = kiln.SamplingParams(
        temperature=1.0, seed=1, n=4, structured_output=kiln.StructuredOutput.choice(["cat", "dog"])
    )
    outputs = llm.generate("My favourite animal is the", choice)[0].outputs
    assert len(outputs) == 4 and all(o.text in ("cat", "dog") and o.finish_reason == "stop" for o in outputs)
    regex = kiln.SamplingParams(
        temperature=0, max_tokens=20, structured_output=kiln.StructuredOutput("regex", "[0-9]{4}")
    )
    assert llm.generate("The year was", regex)[0].outputs[0].text.isdigit()
    tokenizer = llm.get_tokenizer()
    opens, closes = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("Hmm", "Ok"))
    after = kiln.SamplingParams(  # the reply opens a block (forced by the bias), closes it, then the grammar
        temperature=0,
        max_tokens=10,
        logit_bias={opens: 50, closes: 100},
        structured_output=kiln.StructuredOutput.choice(["yes", "no"]),
        reasoning=kiln.ReasoningTokens(opens, closes),
    )
    output = llm.generate("Is water wet?", after)[0].outputs[0]
    assert output.token_ids[:2] == [opens, closes], output.token_ids
    assert tokenizer.decode(output.token_ids[2:]) in ("yes", "no")
    with pytest.raises(ValueError, match="the grammar does not compile"):
        llm.generate("x", kiln.SamplingParams(structured_output=kiln.StructuredOutput("grammar", "root ::=")))


@pytest.mark.slow
def test_structured_output_survives_preemption(smollm2_gguf_path) -> None:
    """8 constrained samples in a KV cache too small for all of them: sequences are preempted and
    recomputed, and every output still matches its constraint."""
    import re

    llm = kiln.LLM(str(smollm2_gguf_path), num_blocks=24, max_num_seqs=8)
    pattern = "([a-z]{2,6} ){39}[a-z]{2,6}"
    params = kiln.SamplingParams(
        temperature=1.0,
        seed=7,
        n=8,
        max_tokens=300,
        structured_output=kiln.StructuredOutput("regex", pattern),
    )
    outputs = llm.generate("Write forty short words:", params)[0].outputs
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text), output.text


@pytest.mark.slow
def test_the_default_is_tvm_with_the_gguf_blocks(smollm2_gguf_path, tmp_path) -> None:
    from kiln.llm import OptionsError, describe
    from kiln.runtime.artifact import is_artifact

    llm = kiln.LLM(str(smollm2_gguf_path), max_num_seqs=2, max_model_len=512)
    assert describe(llm.artifact).startswith("backend tvm, target cpu (")
    assert "quantization gguf" in describe(llm.artifact)
    assert llm.engine.num_blocks == 2 * 512 // 16 + 1  # what the limits need, no more
    assert is_artifact(llm.artifact.path)
    with pytest.raises(OptionsError, match="compiled with backend tvm, not reference"):
        kiln.LLM(str(llm.artifact.path), backend="reference")
    with pytest.raises(OptionsError, match="compiled with quantization gguf, not int4"):
        kiln.LLM(str(llm.artifact.path), quantization="int4")
    with pytest.raises(OptionsError, match="compiled with activation_bits 16, not 8"):
        kiln.LLM(str(llm.artifact.path), activation_bits=8)
    from kiln.cli import main

    assert main(["inspect", str(llm.artifact.path), "--ir"]) == 2  # compiled code: no IR to print
