"""The driver: model source → frontend → IR → backend → something that runs. Only this and cli.py
import every layer."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from kiln.backends.base import Executable
from kiln.backends.reference import ReferenceExecutable
from kiln.frontend.capture import CapturedModel, capture_weights
from kiln.frontend.config import ModelConfig
from kiln.frontend.load import load_model
from kiln.ir import print_graph
from kiln.runtime.tokenizer import Tokenizer


@dataclass
class BuildTimes:
    load_s: float  # read the file, build the tokenizer
    dequantize_s: float  # GGUF blocks to float32 for the reference backend
    capture_s: float  # build the torch.nn model, fx trace, translate to IR, verify


@dataclass
class BuiltModel:
    name: str
    model_id: str  # the model's identity: its name, graph and weight names and shapes, hashed
    config: ModelConfig
    captured: CapturedModel
    executable: Executable
    tokenizer: Tokenizer
    times: BuildTimes


def build_reference(model: str) -> BuiltModel:
    """Load `model` (a known name, a GGUF file or a HF directory), capture it, run it on the reference."""
    start = time.perf_counter()
    source = load_model(model)
    loaded = time.perf_counter()
    weights = source.float_weights()
    dequantized = time.perf_counter()
    captured = capture_weights(source.config, weights)
    captured_at = time.perf_counter()
    info = source.tokenizer
    tokenizer = Tokenizer(
        tokenizer_json=info.tokenizer_json,
        chat_template=info.chat_template,
        bos_token=info.bos_token,
        eos_token=info.eos_token,
        add_bos_token=info.add_bos_token,
        eos_token_ids=tuple(dict.fromkeys([*info.eos_token_ids, *source.config.eos_token_ids])),
    )
    identity = hashlib.sha256(f"{source.name}\n{source.path.resolve()}\n".encode())
    identity.update(print_graph(captured.graph).encode())
    return BuiltModel(
        name=source.name,
        model_id=identity.hexdigest(),
        config=source.config,
        captured=captured,
        executable=ReferenceExecutable(captured.graph, captured.weights),
        tokenizer=tokenizer,
        times=BuildTimes(loaded - start, dequantized - loaded, captured_at - dequantized),
    )
