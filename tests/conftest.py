"""Shared test fixtures. The real-model ones skip, with the reason, where the model is not fetched."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct, GGUF Q4_1: byte-level BPE ("smollm" pre-tokenizer) with a chat template."""
    home = Path(os.environ.get("KILN_HOME", "~/.cache/kiln")).expanduser()
    path = home / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not found at {path}; `make test` fetches it")
    return path


@pytest.fixture(scope="session")
def smollm2_built(smollm2_gguf_path: Path):
    """SmolLM2 loaded from its GGUF, captured, unoptimised (O0) on the reference backend: the oracle."""
    from kiln.build import build_reference

    return build_reference(str(smollm2_gguf_path), opt_level=0)


@pytest.fixture(scope="session")
def smollm2_o2(smollm2_built):
    """The same capture after the O2 pipeline (fusions, LM head on logits rows): faster, same numbers."""
    import dataclasses

    from kiln.backends.reference import ReferenceExecutable
    from kiln.passes import PassManager, PassOptions, pipeline

    program, report = PassManager(pipeline(2, PassOptions())).run(smollm2_built.captured)
    executable = ReferenceExecutable(program.graph, program.weights)
    return dataclasses.replace(smollm2_built, program=program, pass_report=report, executable=executable)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf_path: Path):
    """transformers' own float32 load of the same GGUF: the reference every kiln result is checked on."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()
