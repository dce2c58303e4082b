"""The offline API, in vLLM's shape: `kiln.LLM(model).generate(prompts, kiln.SamplingParams(...))`.

`model` is an artifact folder (from `kiln compile`), or a model (a known name, a GGUF file, a HF
directory), which is compiled into the cache first (see compiler.py) for the fastest path on this host
by default: `backend="auto"` (TVM for this CPU or the local GPU), `quantization="auto"` (a GGUF keeps its
own quantized blocks). The second start only loads.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.build import Progress
from kiln.compiler import (
    AUTO,
    DEFAULT_ACTIVATION_BITS,
    CompileOptions,
    OutputError,
    check_activation_bits,
    check_dtype,
    check_kv_cache_dtype,
    check_targets,
    check_tensor_parallel,
    compile_stages,
    default_tuning_logs,
    load_or_compile,
    plan,
    quantization_arg,
    verdicts_folder,
)
from kiln.console import stage_progress
from kiln.errors import KilnError
from kiln.runtime.artifact import (
    LoadedArtifact,
    close_executable,
    is_artifact,
    load_artifact,
    read_manifest,
)
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.speculative import SpeculativeConfig
from kiln.runtime.tensor_parallel import TensorParallelExecutable, torchrun_rank
from kiln.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]
logger = logging.getLogger(__name__)


def _speculative(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    if not value:
        return None
    try:
        return SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as error:
        raise OptionsError(
            f"speculative config {value!r}: {error}",
            hint='e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} or '
            '{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3}',
        ) from None


class OptionsError(KilnError):
    """Compile options that contradict the artifact they were given with."""


COMPILE_DEFAULTS = {"activation_bits": DEFAULT_ACTIVATION_BITS}  # fields older manifests lack


def _check_artifact_options(folder: Path, asked: dict[str, Any]) -> None:
    """An artifact runs as it was compiled: options asked for explicitly must be what it holds."""
    manifest = read_manifest(folder)
    compiled = manifest["compile"]
    backends = {entry["backend"] for entry in manifest["targets"].values()}
    for name, value in asked.items():
        held = backends if name == "backend" else {compiled.get(name, COMPILE_DEFAULTS.get(name)) or "none"}
        if value not in (None, AUTO) and value not in held:
            flag = "--" + name.replace("_", "-")
            raise OptionsError(
                f"{folder} is an artifact compiled with {name} {', '.join(sorted(map(str, held)))}, "
                f"not {value}",
                hint=f"drop {flag} to run it as compiled, or compile the model again with {flag} {value}",
            )


def open_model(
    model: str,
    *,
    backend: str = AUTO,
    quantization: str | None = AUTO,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    activation_bits: int | None = None,
    target: str | None = None,
    tensor_parallel_size: int | None = None,
    show_progress: bool = True,
) -> LoadedArtifact:
    """An artifact folder as it is, or `model` compiled (once, into the cache) with these options.
    `tensor_parallel_size`: an artifact's own where None; a model's is 1 then."""
    path = Path(model)
    if is_artifact(path):
        asked = {
            "backend": backend,
            "quantization": quantization,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "activation_bits": activation_bits,
        }
        _check_artifact_options(path, asked)
        return load_artifact(
            path, target=target, verdicts=verdicts_folder(), tensor_parallel_size=tensor_parallel_size
        )
    if torchrun_rank() is not None:
        raise OptionsError(
            f"{model}: under torchrun, ranks run an artifact folder, not a model to compile",
            hint="compile it first: kiln compile MODEL --tensor-parallel-size N -o DIR; give every node DIR",
        )
    world = tensor_parallel_size or 1
    chosen = plan(backend, "cpu" if world > 1 and target is None else target)
    check_targets(chosen.backend, chosen.targets)
    check_tensor_parallel(chosen.backend, chosen.targets, world)
    check_kv_cache_dtype(chosen.backend, chosen.targets, kv_cache_dtype or "auto", world)
    check_dtype(chosen.targets, dtype)
    activation_bits = activation_bits or DEFAULT_ACTIVATION_BITS
    check_activation_bits(chosen.backend, chosen.targets, activation_bits)
    options = CompileOptions(
        backend=chosen.backend,
        quantization=quantization_arg(quantization),
        dtype=dtype or "f32",
        kv_cache_dtype=kv_cache_dtype or "auto",
        tuning_logs=default_tuning_logs() if chosen.backend == "tvm" else None,
        tensor_parallel_size=world,
        activation_bits=activation_bits,
    )

    @contextmanager
    def progress_for(folder: Path) -> Iterator[Progress | None]:
        if not show_progress:
            yield None
            return
        targets = ", ".join(t.name for t in chosen.targets)
        ranks = f", {world} tensor-parallel ranks" if world > 1 else ""
        title = (
            f"kiln: first start of {model}: compiling for {chosen.backend} {targets} ({chosen.reason}), "
            f"quantization {quantization or 'none'}{ranks}, into {folder}"
        )
        with stage_progress(title, compile_stages(chosen.targets)) as progress:
            yield progress

    try:
        return load_or_compile(model, options, chosen.targets, progress_for)
    except OutputError as error:
        raise OptionsError(f"the compile cache cannot be written: {error}", hint=error.hint) from None


def open_draft(model: str, target_artifact: LoadedArtifact, **options: Any) -> LoadedArtifact:
    """The draft model of speculative decoding, opened as `open_model` does; its vocabulary must be the
    target's (the verifier compares token ids)."""
    draft = open_model(model, **options)
    if draft.vocab_size != target_artifact.vocab_size:
        raise OptionsError(
            f"draft model {model} has a vocabulary of {draft.vocab_size:,} tokens and "
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
    kv_cache = compiled.get("kv_cache_dtype", "auto")
    kv_cache = f", KV cache {kv_cache}" if kv_cache != "auto" else ""
    activations = ", 8-bit activations" if compiled.get("activation_bits") == 8 else ""
    return (
        f"backend {entry['backend']}, target {target}, quantization {quantization}, "
        f"dtype {compiled.get('dtype', 'f32')}{kv_cache}{activations}{parallel}"
    )


class LLM:
    def __init__(
        self,
        model: str,
        *,
        backend: str = AUTO,
        quantization: str | None = AUTO,
        dtype: str | None = None,
        kv_cache_dtype: str | None = None,
        activation_bits: int | None = None,
        target: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        kv_cache_memory: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        speculative_config: str | dict[str, Any] | None = None,
        tensor_parallel_size: int | None = None,
        show_progress: bool = True,
    ) -> None:
        self.artifact = open_model(
            model,
            backend=backend,
            quantization=quantization,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            activation_bits=activation_bits,
            target=target,
            tensor_parallel_size=tensor_parallel_size,
            show_progress=show_progress,
        )
        speculative = _speculative(speculative_config)
        self.draft_artifact = None
        if speculative is not None and speculative.model is not None:
            self.draft_artifact = open_draft(
                speculative.model,
                self.artifact,
                backend=backend,
                quantization=quantization,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                activation_bits=activation_bits,
                target=target,
                show_progress=show_progress,
            )
        config = EngineConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
            speculative=speculative,
        )
        self.engine = LLMEngine(
            self.artifact.executable,
            self.artifact.tokenizer,
            self.artifact.model_id,
            self.artifact.max_model_len,
            config,
            vocab_size=self.artifact.vocab_size,
            draft=self.draft_artifact.executable if self.draft_artifact is not None else None,
        )
        logger.info("%s: %s; KV cache %s", self.artifact.model_name, describe(self.artifact), self.kv_cache)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks the model runs on, if any (an exiting process stops them too)."""
        close_executable(self.artifact.executable)

    @property
    def kv_cache(self) -> str:
        return self.engine.kv_cache_plan.describe()

    def get_tokenizer(self) -> Tokenizer:
        return self.artifact.tokenizer

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
