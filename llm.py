"""The offline API, in vLLM's shape: `kiln.LLM(model).generate(prompts, kiln.SamplingParams(...))`.

`model` is an artifact folder (from `kiln compile`), or a model (a known name, a GGUF file, a HF
directory), which is compiled into the cache first (see compiler/) for the fastest path on this host
by default: `backend="auto"` (TVM for this CPU or the local GPU), `quantization="auto"` (a GGUF keeps its
own quantized blocks). The second start only loads.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kiln.backends.lora_tables import LoRASpec
from kiln.compiler.options import ModelOptions, OptionsError, check_artifact_options
from kiln.frontend.pull import kiln_home
from kiln.runtime.artifact import (
    MANIFEST,
    LoadedArtifact,
    is_artifact,
    load_artifact,
    sha256_file,
)
from kiln.runtime.engine_options import EngineOptions
from kiln.runtime.lora import AdapterReader, LoRARequest
from kiln.runtime.media import MediaError, MediaPolicy, load_image
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.pooling import PoolingParams
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.tensor_parallel import TensorParallelExecutable, torchrun_rank
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.vision import ImageEmbedding, template_content

if TYPE_CHECKING:
    from kiln.console import Progress
    from kiln.runtime.engine import LLMEngine

# vLLM's prompt forms: a text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids}, either
# with "multi_modal_data" ({"image": PIL image or a list of them}) for a model that takes images
Prompt = str | Sequence[int] | dict[str, Any]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data"})
logger = logging.getLogger(__name__)

__all__ = ["LLM", "EngineOptions", "LoRARequest", "OptionsError", "adapter_reader", "describe", "open_model"]


def adapter_reader(artifact: LoadedArtifact) -> AdapterReader:
    """Reads LoRA adapter files (frontend/lora.py) for the model of `artifact`."""
    from kiln.frontend.lora import read_adapter
    from kiln.ir.adapters import AdapterBase

    config = artifact.manifest["model"]["config"]
    base = AdapterBase(
        str(config["architecture"]), int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    )
    return lambda path: read_adapter(path, base)


def open_model(options: ModelOptions, show_progress: bool = True) -> LoadedArtifact:
    """An artifact folder as it is (the compiled options asked for must be what it holds), or the model
    compiled (once, into the cache) as `compiler.resolve` plans it."""
    path = Path(options.model)
    if is_artifact(path):
        check_artifact_options(path, options)
        return load_artifact(
            path,
            target=options.target,
            verdicts=kiln_home() / "verified",  # compiler.cache.verdicts_folder()
            tensor_parallel_size=options.tensor_parallel_size,
        )
    if torchrun_rank() is not None:
        raise OptionsError(
            f"{options.model}: under torchrun, ranks run an artifact folder, not a model to compile",
            hint="compile it first: kiln compile MODEL --tensor-parallel-size N -o DIR; give every node DIR",
        )
    from kiln.compiler import resolve

    plan = resolve(options)  # what the options contradict is refused here, before the compiler loads
    from kiln.compiler import OutputError, load_or_compile

    @contextmanager
    def progress_for(folder: Path) -> Iterator[Progress | None]:
        if not show_progress:
            yield None
            return
        targets = ", ".join(t.name for t in plan.targets)
        ranks = (
            f", {plan.tensor_parallel_size} tensor-parallel ranks" if plan.tensor_parallel_size > 1 else ""
        )
        title = (
            f"kiln: first start of {plan.model}: compiling for {plan.backend} {targets} ({plan.reason}), "
            f"quantization {plan.quantization or 'none'}{ranks}, into {folder}"
        )
        from kiln.compiler import compile_stages
        from kiln.console import stage_progress

        with stage_progress(title, compile_stages(plan.targets)) as progress:
            yield progress

    try:
        return load_or_compile(plan, progress_for)
    except OutputError as error:
        raise OptionsError(f"the compile cache cannot be written: {error}", hint=error.hint) from None


def open_draft(options: ModelOptions, target_artifact: LoadedArtifact, show_progress: bool) -> LoadedArtifact:
    """The draft model of speculative decoding, opened with the target's options; its vocabulary must be
    the target's (the verifier compares token ids)."""
    draft = open_model(options, show_progress)
    if draft.vocab_size != target_artifact.vocab_size:
        raise OptionsError(
            f"draft model {options.model} has a vocabulary of {draft.vocab_size:,} tokens and "
            f"{target_artifact.model_name} one of {target_artifact.vocab_size:,}; a draft must share the "
            "target's vocabulary",
            hint="pick a smaller model of the same family (same tokenizer), or method ngram",
        )
    return draft


def describe(artifact: LoadedArtifact) -> str:
    """backend, target and quantization of a loaded artifact, for a person."""
    entry = artifact.target_entry
    compiled = artifact.manifest["compile"]
    target = artifact.target.name
    mcpu = entry.get("mcpu")
    if mcpu and artifact.target.kind == "cpu" and artifact.target.detail is None:
        target = f"{target} ({mcpu})"
    quantization = compiled.get("quantization") or "none"
    ranks = artifact.executable
    parallel = f", tensor-parallel {ranks.world}" if isinstance(ranks, TensorParallelExecutable) else ""
    kv_cache = compiled.get("kv_cache_dtype")
    kv_cache = f", KV cache {kv_cache}" if kv_cache not in (None, "auto") else ""  # auto: older manifests
    activations = ", 8-bit activations" if compiled.get("activation_bits") == 8 else ""
    return (
        f"backend {entry['backend']}, target {target}, quantization {quantization}, "
        f"dtype {compiled.get('dtype', 'f32')}{kv_cache}{activations}{parallel}"
    )


def split_options(model: str, options: dict[str, Any]) -> tuple[ModelOptions, EngineOptions]:
    """`kiln.LLM`'s keywords as the model's options and the engine's; an unknown keyword is refused
    naming the known ones."""
    engine_names = EngineOptions.names()
    model_names = ModelOptions.names()
    unknown = sorted(set(options) - set(engine_names) - set(model_names))
    if unknown:
        known = ", ".join((*model_names, *engine_names))
        raise OptionsError(f"unknown option {', '.join(unknown)}", hint=f"options: {known}")
    engine = {name: value for name, value in options.items() if name in engine_names}
    model_options = {name: value for name, value in options.items() if name not in engine_names}
    return ModelOptions(model, **model_options), EngineOptions(**engine)


class LLM:
    """`model` and its options as keywords: the model options (`kiln.compiler.ModelOptions`: backend,
    target, quantization, dtype, kv_cache_dtype, activation_bits, tensor_parallel_size, enable_lora, ...)
    and the engine options (`kiln.runtime.engine_options.EngineOptions`: max_model_len, max_num_seqs,
    max_num_batched_tokens, the KV cache's size, kv_offload_dir, speculative_config, max_loras, pooling,
    ...); an unknown keyword is refused naming the known ones. `show_progress`: show a compile's stages."""

    def __init__(self, model: str, *, show_progress: bool = True, **options: Any) -> None:
        model_options, engine_options = split_options(model, options)
        self._start(model_options, engine_options, show_progress)

    @classmethod
    def from_options(
        cls, options: ModelOptions, engine_options: EngineOptions, show_progress: bool = True
    ) -> LLM:
        """As `LLM(model, **keywords)`, from the options objects (the CLI's, made from its flags)."""
        llm = cls.__new__(cls)
        llm._start(options, engine_options, show_progress)
        return llm

    def _start(self, options: ModelOptions, engine_options: EngineOptions, show_progress: bool) -> None:
        self.options = options
        self.engine_options = engine_options
        self.artifact = open_model(self.options, show_progress)
        speculative = engine_options.speculative_config
        self.draft_artifact = None
        if speculative is not None and speculative.model is not None:
            draft_options = dataclasses.replace(
                self.options, model=speculative.model, tensor_parallel_size=None
            )
            self.draft_artifact = open_draft(draft_options, self.artifact, show_progress)
        config = engine_options.engine_config(self.artifact.pooling, self._kv_offload_identity())
        from kiln.runtime.engine import LLMEngine  # the model is open: what refuses it came first

        self.engine: LLMEngine = LLMEngine(
            self.artifact.executable,
            self.artifact.tokenizer,
            self.artifact.model_id,
            self.artifact.max_model_len,
            config,
            vocab_size=self.artifact.vocab_size,
            draft=self.draft_artifact.executable if self.draft_artifact is not None else None,
            vision=self.artifact.vision,
            lora=engine_options.lora_config() if self.serves_lora else None,
            adapter_reader=adapter_reader(self.artifact) if self.serves_lora else None,
        )
        logger.info("%s: %s; KV cache %s", self.artifact.model_name, describe(self.artifact), self.kv_cache)
        self._ids = itertools.count()

    def _kv_offload_identity(self) -> str:
        """The artifact and target offloaded KV blocks belong to ("" where none are offloaded)."""
        if not self.engine_options.offloads_kv:
            return ""
        if isinstance(self.artifact.executable, TensorParallelExecutable):
            raise OptionsError(
                "KV offload does not run with tensor parallelism yet (each rank holds its own KV cache)",
                hint="serve without --kv-offload-dir, or at --tensor-parallel-size 1",
            )
        # the manifest names every file of the artifact by its sha256, so its own hash is the artifact's
        return f"{sha256_file(self.artifact.path / MANIFEST)}/{self.artifact.target.name}"

    @property
    def serves_lora(self) -> bool:
        """Whether adapters can be served: asked for, or an artifact folder compiled with them."""
        compiled_with = LoRASpec.of_signature(self.artifact.executable.signature)
        return self.options.enable_lora or compiled_with is not None

    def close(self) -> None:
        """Finish the KV blocks queued for the offload folder; stop the tensor-parallel ranks the model runs
        on, if any (an exiting process stops them too)."""
        self.engine.close()
        self.artifact.executable.close()

    @property
    def kv_cache(self) -> str:
        return self.engine.kv_cache_plan.describe()

    def get_tokenizer(self) -> Tokenizer:
        return self.artifact.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; the outputs in the prompts' order. `lora_request`:
        one adapter for every prompt, or a list with one entry per prompt (None: the base model)."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = [self.engine_prompt(prompt) for prompt in prompts]  # type: ignore[union-attr]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompt_list)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        for request_id, (prompt, images), params, lora in zip(
            ids, prompt_list, params_list, loras, strict=True
        ):
            self.engine.add_request(request_id, prompt, params, images=images, lora_request=lora)
        finished = {output.request_id: output for output in self.engine.run_to_completion()}
        return [finished[request_id] for request_id in ids]

    def embed(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        *,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[npt.NDArray[np.float32]]:
        """Each prompt (a text or token ids) as one vector: its final hidden states pooled as the engine's
        `pooling` says, the first `dimensions` values kept, scaled to unit length with `normalize`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = PoolingParams(self.engine.config.pooling, normalize, dimensions)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(request_id, prompt, pooling=params)  # type: ignore[arg-type]
        finished = {output.request_id: output for output in self.engine.run_to_completion()}
        return [finished[request_id].embedding for request_id in ids]  # type: ignore[misc]

    def engine_prompt(self, prompt: Prompt) -> tuple[str | Sequence[int], list[ImageEmbedding]]:
        """A prompt as the engine takes it, with its images embedded; a ValueError for a dict it cannot
        serve."""
        if not isinstance(prompt, dict):
            return prompt, []
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise ValueError(f"a prompt dict takes {sorted(PROMPT_KEYS)}, not {sorted(unknown)}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict holds exactly one of prompt and prompt_token_ids")
        data = prompt.get("multi_modal_data") or {}
        for modality in data:
            if modality not in self.engine.input_modalities:
                takes = ", ".join(self.engine.input_modalities)
                raise ValueError(f"multi_modal_data[{modality!r}]: this model takes {takes} only")
        images = data.get("image", [])
        images = images if isinstance(images, list | tuple) else [images]
        embedded = [self._embed(image, f"multi_modal_data['image'][{i}]") for i, image in enumerate(images)]
        return prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"], embedded

    def _embed(self, image: Any, where: str) -> ImageEmbedding:
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}: a PIL image, not {type(image).__name__}")
        assert self.artifact.vision is not None
        return self.artifact.vision.embed(image)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        media: MediaPolicy | None = None,
    ) -> RequestOutput:
        """One conversation; a message's content is a text or OpenAI's list of parts (`image_url` parts
        where the model takes images: data: URLs, or what `media` allows; `image_pil` parts: PIL images)."""
        return self.generate([self.chat_prompt(messages, media)], sampling_params)[0]

    def chat_prompt(self, messages: list[dict[str, Any]], media: MediaPolicy | None = None) -> Prompt:
        """The conversation through the chat template, as a prompt `generate` takes (with its images)."""
        tokenizer = self.get_tokenizer()
        images: list[Any] = []
        messages = [self._chat_message(i, message, images, media) for i, message in enumerate(messages)]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids

    def _chat_message(
        self, index: int, message: dict[str, Any], images: list[Any], media: MediaPolicy | None
    ) -> dict[str, Any]:
        """A message with its content as its chat template reads it, its images appended to `images`; a
        ValueError naming a part this model cannot take."""
        content = message.get("content")
        if not isinstance(content, list):
            return message
        parts: list[str | None] = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append(part["text"])
            elif kind in ("image_url", "image_pil") and "image" not in self.engine.input_modalities:
                raise ValueError(f"{where} is an image, and this model takes text only")
            elif kind == "image_url":
                url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                try:
                    images.append(load_image(url, media or MediaPolicy()))
                except MediaError as error:
                    raise ValueError(f"{where}: {error}") from None
                parts.append(None)
            elif kind == "image_pil":
                images.append(part["image_pil"])
                parts.append(None)
            else:
                raise ValueError(f"{where}: unknown content part type {kind!r}")
        if all(part is not None for part in parts):
            return {**message, "content": "\n".join(p for p in parts if p is not None)}
        vision = self.artifact.vision
        assert vision is not None
        template = self.get_tokenizer().chat_template
        return {**message, "content": template_content(parts, vision.spec.placeholder_text, template)}
