"""TVM CPU executables of the shared test programs, compiled once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.backends.base import CompileSettings, Executable
from kiln.backends.targets import Target
from kiln.backends.tvm.backend import TVMBackend
from kiln.frontend.capture import capture_weights
from kiln.frontend.config import ModelConfig
from kiln.frontend.models import model_class
from kiln.ir import Program
from kiln.passes import PassManager, PassOptions, pipeline

TINY_LLAMA = ModelConfig(  # the tiny Llama of tests/runtime/conftest.py
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


def compile_tvm_cpu(program: Program, folder: Path) -> Executable:
    backend = TVMBackend()
    backend.compile(program, Target("cpu"), folder, CompileSettings())
    return backend.load(folder, program.weights, Target("cpu"))


@pytest.fixture(scope="session")
def tiny_llama_program() -> Program:
    """The tiny Llama with random weights (seed 0), at O2: no HF files, quick to compile."""
    with torch.device("meta"):
        shapes = model_class(TINY_LLAMA)(TINY_LLAMA).state_dict()
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(t.shape, generator=generator) * 0.5 for name, t in shapes.items()}
    captured = capture_weights(TINY_LLAMA, weights)
    program, _ = PassManager(pipeline(2, PassOptions())).run(Program(captured.graph, captured.weights))
    return program


@pytest.fixture(scope="session")
def tvm_compile():
    return compile_tvm_cpu


@pytest.fixture(scope="session")
def smollm2_tvm(smollm2_o2, tmp_path_factory: pytest.TempPathFactory) -> Executable:
    """SmolLM2 float32 at O2 on TVM-CPU."""
    return compile_tvm_cpu(smollm2_o2.program, tmp_path_factory.mktemp("smollm2-tvm"))


@pytest.fixture(scope="session")
def smollm2_q4_1(smollm2_gguf_path: Path):
    """SmolLM2 with its GGUF Q4_1 (and Q8_0 LM head) blocks imported, O2, on the reference backend."""
    from kiln.build import build_reference

    return build_reference(str(smollm2_gguf_path), opt_level=2, quantization="gguf")
