"""The one pipeline: model source → frontend → IR → passes. Every command that needs a graph (compile,
tune, inspect, the reference oracle, the GPU bundle) calls `build_program` or, for weights it makes
itself, `optimize`. It runs the frontend and the passes, so it sits in compiler/, which imports every layer
below it."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.backends.base import Executable
from kiln.backends.reference import ReferenceExecutable
from kiln.compiler.options import PipelineOptions
from kiln.console import Progress
from kiln.frontend.capture import capture_weights
from kiln.frontend.config import ModelConfig
from kiln.frontend.load import load_model
from kiln.frontend.source import ModelSource, QuantizedTensor
from kiln.frontend.vision import encoder_program
from kiln.ir import Program, print_graph
from kiln.passes import Pass, PassManager, PassOptions, PassReport, pipeline
from kiln.passes.base import GGUF_MIXES, pass_quantization
from kiln.passes.quantize.gguf_mix import MixModel, encoded_blocks
from kiln.passes.shard import shard_with_blocks
from kiln.runtime.tokenizer import Tokenizer


@dataclass
class Optimized:
    quantization: str | None
    captured: Program  # the graph as captured (O0)
    program: Program  # after the pass pipeline
    passes: list[Pass]
    report: PassReport
    gguf_types: dict[str, str]  # the weights imported as GGUF blocks: their block types


@dataclass
class BuiltProgram(Optimized):
    source: ModelSource
    tokenizer: Tokenizer
    seconds: dict[str, float]  # load, dequantize, capture, passes
    encoder: Program | None = None  # a vision-language model's image encoder, optimized (float32)

    @property
    def config(self) -> ModelConfig:
        return self.source.config


def gguf_blocks(source: ModelSource) -> dict[str, QuantizedTensor]:
    """The GGUF quantized blocks of `source`, by weight name, for the gguf quantization import."""
    return {name: weight for name, weight in source.weights.items() if isinstance(weight, QuantizedTensor)}


def runtime_tokenizer(source: ModelSource) -> Tokenizer:
    """The runtime tokenizer, stopping on the tokenizer's EOS ids and the model config's."""
    merged = tuple(dict.fromkeys([*source.tokenizer.eos_token_ids, *source.config.eos_token_ids]))
    return Tokenizer.from_dict(
        dataclasses.asdict(dataclasses.replace(source.tokenizer, eos_token_ids=merged))
    )


def pass_options(options: PipelineOptions, source: ModelSource | None = None) -> PassOptions:
    """Pass options; the gguf quantization imports `source`'s GGUF blocks, the LM head's too (llama.cpp
    multiplies by them as well). A llama.cpp mix (q4_k_m, ...) is the gguf import of the blocks
    `optimize` makes of the captured weights."""
    quantization = pass_quantization(options.quantization)
    gguf = options.quantization == "gguf"
    return PassOptions(
        quantization=quantization,
        group_size=options.group_size,
        dtype=options.dtype,
        kv_cache_dtype=options.kv_cache_dtype,
        lora=options.enable_lora,
        lora_dtype=options.lora_dtype,
        gguf_blocks=gguf_blocks(source) if gguf and source is not None else {},
        quantize_lm_head=quantization == "gguf",
    )


def mix_model(config: ModelConfig) -> MixModel:
    """What llama-quantize's choice of block types reads of `config` beside the tensors."""
    seventy_b = config.num_hidden_layers == 80 and (
        config.architecture == "Qwen2ForCausalLM"
        or (
            config.architecture == "LlamaForCausalLM"
            and config.num_attention_heads != config.num_key_value_heads
        )
    )
    return MixModel(config.num_hidden_layers, config.num_experts, seventy_b)


def optimize(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    options: PipelineOptions,
    source: ModelSource | None = None,
    progress: Progress | None = None,
    gguf: dict[str, QuantizedTensor] | None = None,
) -> Optimized:
    """Capture the model of `config` with float32 `weights`, then run the pass pipeline. With a
    `context_len` below the model's maximum the model is captured for that context (longrope then takes
    its short factors when the context fits the original one). `gguf`: the GGUF blocks the gguf
    quantization imports (by default `source`'s)."""
    start = time.perf_counter()
    if options.context_len is not None and options.context_len < config.max_position_embeddings:
        config = dataclasses.replace(config, max_position_embeddings=options.context_len)
    captured = capture_weights(config, weights)
    whole_program = Program(captured.graph, captured.weights)
    options_for_passes = pass_options(options, source)
    if gguf is not None:
        options_for_passes = dataclasses.replace(options_for_passes, gguf_blocks=gguf)
    elif options.quantization in GGUF_MIXES:
        encoded = encoded_blocks(whole_program, options.quantization, mix_model(config))
        options_for_passes = dataclasses.replace(options_for_passes, gguf_blocks=encoded)
    gguf_types = {name: blocks.ggml_type for name, blocks in sorted(options_for_passes.gguf_blocks.items())}
    captured_program, blocks = shard_with_blocks(
        whole_program,
        options.tensor_parallel_size,
        options.rank,
        options_for_passes.gguf_blocks,
    )
    options_for_passes = dataclasses.replace(options_for_passes, gguf_blocks=blocks)
    captured_at = time.perf_counter()
    if progress is not None:
        progress("capture", captured_at - start)
    passes = pipeline(options.opt_level, options_for_passes)
    program, report = PassManager(passes).run(captured_program, options_for_passes)
    if progress is not None:
        progress("passes", time.perf_counter() - captured_at)
    return Optimized(options_for_passes.quantization, captured_program, program, passes, report, gguf_types)


def build_program(
    model: str,
    options: PipelineOptions | None = None,
    progress: Progress | None = None,
    mmproj: Path | None = None,
) -> BuiltProgram:
    """Load `model` (a known name, a GGUF file or a HF directory; `mmproj`: a GGUF's image encoder),
    capture it, run the pass pipeline."""
    options = options or PipelineOptions()
    seconds: dict[str, float] = {}

    def timed(stage: str, took: float) -> None:
        seconds[stage] = took
        if progress is not None:
            progress(stage, took)

    start = time.perf_counter()
    source = load_model(model, mmproj)
    loaded = time.perf_counter()
    weights = source.float_weights()
    timed("load", time.perf_counter() - start)
    seconds["dequantize"] = time.perf_counter() - loaded
    optimized = optimize(source.config, weights, options, source, timed)
    return BuiltProgram(
        **{f.name: getattr(optimized, f.name) for f in dataclasses.fields(Optimized)},
        source=source,
        tokenizer=runtime_tokenizer(source),
        seconds=seconds,
        encoder=optimize_encoder(source, options.opt_level),
    )


def optimize_encoder(source: ModelSource, opt_level: int) -> Program | None:
    """A vision-language model's image encoder, captured, through the pass pipeline of `opt_level` in
    float32 (its q/k/v projections fused into one linear, like the text model's); None for a text
    model."""
    if source.vision is None:
        return None
    float_options = PassOptions()
    captured = encoder_program(source.vision)
    program, _ = PassManager(pipeline(opt_level, float_options)).run(captured, float_options)
    return program


def rank_programs(built: BuiltProgram, options: PipelineOptions) -> list[Program]:
    """The programs of ranks 1.. of `options.tensor_parallel_size`, beside `built` (rank 0's): each
    rank's shard of the same weights through the same pipeline."""
    if options.tensor_parallel_size == 1:
        return []
    weights = built.source.float_weights()
    return [
        optimize(built.config, weights, dataclasses.replace(options, rank=rank), built.source).program
        for rank in range(1, options.tensor_parallel_size)
    ]


@dataclass
class BuiltModel:
    """A built program on the reference backend: the oracle."""

    name: str
    model_id: str  # the model's identity: its name, path and optimized graph, hashed
    config: ModelConfig
    captured: Program  # the graph as captured (O0)
    program: Program  # after the pass pipeline
    pass_report: PassReport
    executable: Executable
    tokenizer: Tokenizer
    seconds: dict[str, float]  # load, dequantize, capture, passes


def build_reference(model: str, options: PipelineOptions | None = None) -> BuiltModel:
    """`build_program`, loaded on the reference backend."""
    built = build_program(model, options)
    identity = hashlib.sha256(f"{built.source.name}\n{built.source.path.resolve()}\n".encode())
    identity.update(print_graph(built.program.graph).encode())
    program = built.program
    return BuiltModel(
        name=built.source.name,
        model_id=identity.hexdigest(),
        config=built.config,
        captured=built.captured,
        program=program,
        pass_report=built.report,
        executable=ReferenceExecutable(program.graph, program.weights),
        tokenizer=built.tokenizer,
        seconds=built.seconds,
    )
