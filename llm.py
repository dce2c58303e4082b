"""The offline API, in vLLM's shape: `kiln.LLM(model).generate(prompts, kiln.SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kiln.build import BuiltModel, build_reference
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str,
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        kv_cache_memory: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.built: BuiltModel = build_reference(model)
        config = EngineConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
        )
        self.engine = LLMEngine(
            self.built.executable,
            self.built.tokenizer,
            self.built.model_id,
            self.built.config.max_position_embeddings,
            config,
        )
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.built.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; the outputs in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        for request_id, prompt, params in zip(ids, prompt_list, params_list, strict=True):
            self.engine.add_request(request_id, prompt, params)
        finished = {output.request_id: output for output in self.engine.run_to_completion()}
        return [finished[request_id] for request_id in ids]

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        tokenizer = self.get_tokenizer()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([tokenizer.encode(text, add_special_tokens=False)], sampling_params)[0]
