"""The offline API, in vLLM's shape: `kiln.LLM(model).generate(prompts, kiln.SamplingParams(...))`.

`model` is an artifact folder (from `kiln compile`), or a model (a known name, a GGUF file, a HF
directory), which is compiled into the cache first ($KILN_HOME/artifacts/<key>, keyed by the model's
bytes and the compile options), so the second start only loads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from kiln import __version__
from kiln.backends.registry import get_backend
from kiln.backends.targets import Target
from kiln.compiler import CompileOptions, compile_model, source_digest
from kiln.frontend.pull import kiln_home, resolve_model
from kiln.runtime.artifact import ArtifactError, LoadedArtifact, is_artifact, load_artifact
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]
logger = logging.getLogger(__name__)


_COMPILER_CODE = ("frontend", "ir", "passes", "backends", "compiler.py", "build.py")


def compiler_digest() -> str:
    """The sha256 of the code that turns a model into an artifact: a cache entry made by other code
    is never reused (the version number alone does not change between commits)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for part in _COMPILER_CODE:
        files = [root / part] if part.endswith(".py") else sorted((root / part).rglob("*.py"))
        for file in files:
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def cached_artifact(model: str, options: CompileOptions) -> Path:
    """The cache folder for `model` compiled with `options` for this CPU, compiling it if needed."""
    path = resolve_model(model)
    key_parts = {
        "source": source_digest(path),
        "options": options.as_dict(),
        "kiln": __version__,
        "compiler": compiler_digest(),
        "backend": get_backend(options.backend).version(),
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:24]
    folder = kiln_home() / "artifacts" / key
    if is_artifact(folder):
        return folder
    logger.info("compiling %s into %s", model, folder)
    compile_model(model, [Target("cpu")], options, folder)
    _evict_old_entries(folder.parent, keep=CACHE_ENTRIES)
    return folder


CACHE_ENTRIES = 4


def _evict_old_entries(cache: Path, keep: int) -> None:
    """Keep the `keep` most recently compiled cache entries (each can be hundreds of MB)."""
    import shutil

    entries = [p for p in cache.iterdir() if is_artifact(p)]
    for stale in sorted(entries, key=lambda p: p.stat().st_mtime, reverse=True)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


def load_or_compile(model: str, options: CompileOptions | None = None) -> LoadedArtifact:
    path = Path(model)
    if is_artifact(path):
        return load_artifact(path)
    folder = cached_artifact(model, options or CompileOptions())
    try:
        return load_artifact(folder)
    except ArtifactError:  # a damaged cache entry: compile it again
        compile_model(model, [Target("cpu")], options or CompileOptions(), folder)
        return load_artifact(folder)


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
        quantization: str | None = None,
        dtype: str = "f32",
    ) -> None:
        self.artifact = load_or_compile(model, CompileOptions(quantization=quantization, dtype=dtype))
        config = EngineConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
        )
        self.engine = LLMEngine(
            self.artifact.executable,
            self.artifact.tokenizer,
            self.artifact.model_id,
            self.artifact.max_model_len,
            config,
        )
        self._ids = itertools.count()

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
