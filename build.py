"""The driver: model source → frontend → IR → passes → backend → something that runs. Only this,
cli.py and llm.py import every layer."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

from kiln.backends.base import Executable
from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import capture_weights
from kiln.frontend.config import ModelConfig
from kiln.frontend.load import load_model
from kiln.frontend.source import ModelSource, QuantizedTensor
from kiln.ir import Program, print_graph
from kiln.passes import PassManager, PassOptions, PassReport, pipeline
from kiln.runtime.tokenizer import Tokenizer


@dataclass
class BuildTimes:
    load_s: float  # read the file, build the tokenizer
    dequantize_s: float  # GGUF blocks to float32 for capture (and the reference backend)
    capture_s: float  # build the torch.nn model, fx trace, translate to IR, verify
    passes_s: float


@dataclass
class BuiltModel:
    name: str
    model_id: str  # the model's identity: its name, path and optimized graph, hashed
    config: ModelConfig
    captured: Program  # the graph as captured (O0)
    program: Program  # after the pass pipeline
    pass_report: PassReport
    executable: Executable
    tokenizer: Tokenizer
    times: BuildTimes


def gguf_blocks(source: ModelSource) -> dict[str, tuple[str, object]]:
    """The GGUF quantized blocks of `source`, by weight name, for the gguf quantization import."""
    return {
        name: (weight.ggml_type, weight.blocks)
        for name, weight in source.weights.items()
        if isinstance(weight, QuantizedTensor)
    }


def runtime_tokenizer(source: ModelSource) -> Tokenizer:
    """The runtime tokenizer, stopping on the tokenizer's EOS ids and the model config's."""
    merged = tuple(dict.fromkeys([*source.tokenizer.eos_token_ids, *source.config.eos_token_ids]))
    return Tokenizer.from_dict(
        dataclasses.asdict(dataclasses.replace(source.tokenizer, eos_token_ids=merged))
    )


def pass_options(source: ModelSource, quantization: str | None, group_size: int, dtype: str) -> PassOptions:
    """Pass options for `source`: the gguf quantization imports its GGUF blocks."""
    blocks = gguf_blocks(source) if quantization == "gguf" else {}
    # gguf: the LM head too, from the GGUF's own blocks (llama.cpp multiplies by them as well)
    return PassOptions(
        quantization=quantization,
        group_size=group_size,
        dtype=dtype,
        gguf_blocks=blocks,
        quantize_lm_head=quantization == "gguf",
    )


def build_reference(
    model: str,
    opt_level: int = 2,
    quantization: str | None = None,
    dtype: str = "f32",
    group_size: int = 32,
) -> BuiltModel:
    """Load `model` (a known name, a GGUF file or a HF directory), capture it, run the pass pipeline
    for `opt_level` (and quantization / dtype), and load the result on the reference backend."""
    start = time.perf_counter()
    source = load_model(model)
    loaded = time.perf_counter()
    weights = source.float_weights()
    dequantized = time.perf_counter()
    captured = capture_weights(source.config, weights)
    captured_at = time.perf_counter()
    options = pass_options(source, quantization, group_size, dtype)
    captured_program = Program(captured.graph, captured.weights)
    program, report = PassManager(pipeline(opt_level, options)).run(captured_program, options)
    passes_done = time.perf_counter()
    identity = hashlib.sha256(f"{source.name}\n{source.path.resolve()}\n".encode())
    identity.update(print_graph(program.graph).encode())
    return BuiltModel(
        name=source.name,
        model_id=identity.hexdigest(),
        config=source.config,
        captured=captured_program,
        program=program,
        pass_report=report,
        executable=ReferenceExecutable(program.graph, program.weights),
        tokenizer=runtime_tokenizer(source),
        times=BuildTimes(
            loaded - start, dequantized - loaded, captured_at - dequantized, passes_done - captured_at
        ),
    )
