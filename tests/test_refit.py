"""New weights through an artifact's own pipeline (compiler/refit.py): float (reference: transformers'
logits), int8 on TVM (the same bytes a compile of those weights gives), GGUF blocks (floats quantized by
llama.cpp's reference quantizers as llama-quantize does; a type kiln cannot quantize refused, named; a
llama.cpp mix of a HF checkpoint, K-quants included), and the weights refused by name, shape or
completeness."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from kiln.backends.base import BackendError, allocate_kv_cache
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.registry import get_backend
from kiln.compiler import ModelOptions, compile_model, resolve
from kiln.compiler.build import optimize
from kiln.compiler.refit import Refitter
from kiln.frontend.pull import kiln_home
from kiln.ir.step import SequenceSlice, build_step_inputs
from kiln.runtime.artifact import load_artifact
from kiln.runtime.live_weights import WeightUpdateError
from kiln.runtime.tensor_parallel import StagedRanks
from tests.backends.conftest import save_tiny_hf
from tests.backends.reference.test_llama_cpp_converted import convert, save_byte_level_tokenizer

PROMPT = [3, 7, 9, 11, 2, 5, 40, 41]


def last_logits(executable: Any) -> np.ndarray:
    cache = allocate_kv_cache(executable, 3, 16)
    return executable.step(build_step_inputs([SequenceSlice(PROMPT, 0, [1])], 16), cache)[0]


def nudged(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The model's parameters moved a little (a training step's worth), in place; by name."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def compiled(hf: Path, out: Path, **options: Any) -> Any:
    compile_model(resolve(ModelOptions.create(str(hf), **options)), out, force=True)
    return load_artifact(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("refit") / "llama"
    return folder, save_tiny_hf("llama", folder)


@pytest.mark.parametrize("backend", ["reference", "onnxruntime"])
def test_float_weights_give_transformers_logits(backend: str, tiny, tmp_path: Path) -> None:
    hf, _ = tiny
    refitter = Refitter(compiled(hf, tmp_path / "a", backend=backend, quantization="none"))
    trained = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tensors = nudged(trained, 1)
    with torch.no_grad():
        expected = trained(torch.tensor([PROMPT])).logits[0, -1].numpy()
    logits = last_logits(refitter.from_tensors(tensors))
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5
    trained.save_pretrained(tmp_path / "trained")
    assert np.array_equal(last_logits(refitter.from_path(str(tmp_path / "trained"))), logits)


def test_bad_weights_are_refused_by_name(tiny, tmp_path: Path) -> None:
    hf, model = tiny
    refitter = Refitter(compiled(hf, tmp_path / "a", backend="reference", quantization="none"))
    good = {name: param.detach() for name, param in model.named_parameters()}
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        (
            {**good, "model.layers.9.mlp.up_proj.weight": good[q]},
            "model.layers.9.mlp.up_proj.weight: the model has no",
        ),
        ({**good, q: good[q][:-1]}, rf"{q}: shape \[63, 64\], the model's is \[64, 64\]"),
        ({n: t for n, t in good.items() if n != q}, f"{q} is missing"),
        ({**good, q: good[q].to(torch.int32)}, f"{q}: dtype torch.int32 is no float"),
    ]
    for tensors, message in cases:
        with pytest.raises(WeightUpdateError, match=message):
            refitter.from_tensors(tensors)
    with pytest.raises(WeightUpdateError, match=r"model.embed_tokens.weight: shape"):
        refitter.check_tensor("model.embed_tokens.weight", "float32", [7, 64])
    with pytest.raises(WeightUpdateError, match="dtype int8"):
        refitter.check_tensor(q, "int8", [64, 64])
    refitter.check_tensor(q, "bfloat16", [64, 64])
    with pytest.raises(WeightUpdateError, match="no such"):
        refitter.from_path(str(tmp_path / "absent"))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_take_the_artifacts_quantizer(quantization: str, tiny, tmp_path: Path) -> None:
    hf, _ = tiny
    refitter = Refitter(compiled(hf, tmp_path / "a", backend="reference", quantization=quantization))
    tensors = nudged(transformers.AutoModelForCausalLM.from_pretrained(hf).eval(), 3)
    program = optimize(refitter.config, tensors, refitter.options).program
    assert refitter.options.quantization == quantization
    expected = last_logits(ReferenceExecutable(program.graph, program.weights))
    assert np.array_equal(last_logits(refitter.from_tensors(tensors)), expected)


def test_int8_on_tvm_is_what_a_compile_of_the_new_weights_holds(tiny, tmp_path: Path) -> None:
    """The compile writes each weight as `lay_out(program weight)`; TVM given the program's weights lays
    them out the same way in memory: the refitted executable must read exactly those bytes."""
    hf, _ = tiny
    artifact = compiled(hf, tmp_path / "a", backend="tvm", quantization="int8")
    refitter = Refitter(artifact)
    trained = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tensors = nudged(trained, 2)
    program = optimize(refitter.config, tensors, refitter.options).program
    code = artifact.path / artifact.target_entry["folder"]
    fresh = get_backend("tvm").load(code, program.weights, artifact.target)
    refitted = last_logits(refitter.from_tensors(tensors))
    assert np.array_equal(refitted, last_logits(fresh))
    assert not np.array_equal(refitted, last_logits(artifact.executable))


def test_gguf_blocks_take_floats_as_llama_cpp_quantizes_them(tmp_path: Path, llama_cpp_source: Path) -> None:
    hf = tmp_path / "llama"
    model = save_tiny_hf("llama", hf, {"vocab_size": 320, "bos_token_id": 1, "eos_token_id": 2})
    save_byte_level_tokenizer(hf)
    gguf_path = convert(llama_cpp_source, hf, "q8_0", kiln_home() / "models" / "converted")
    artifact = compiled(gguf_path, tmp_path / "a", backend="reference", quantization="gguf")
    refitter = Refitter(artifact)
    assert set(refitter.gguf_types.values()) == {"Q8_0"}
    floats = {name: param.detach() for name, param in model.named_parameters()}
    assert np.array_equal(last_logits(refitter.from_tensors(floats)), last_logits(artifact.executable))
    assert np.array_equal(last_logits(refitter.from_path(str(gguf_path))), last_logits(artifact.executable))
    name = next(iter(refitter.gguf_types))
    refitter.gguf_types = {**refitter.gguf_types, name: "Q3_K"}
    with pytest.raises(WeightUpdateError, match=f"{name}: the artifact keeps it as Q3_K blocks"):
        refitter.from_tensors(floats)
    with pytest.raises(WeightUpdateError, match=f"{name}: Q8_0 blocks, the artifact's are Q3_K"):
        refitter.from_path(str(gguf_path))


def test_a_q4_k_m_artifact_of_a_hf_checkpoint_takes_float_weights(tmp_path: Path) -> None:
    hf = tmp_path / "llama"
    model = save_tiny_hf("llama", hf, {"hidden_size": 256, "intermediate_size": 512})
    artifact = compiled(hf, tmp_path / "a", backend="reference", quantization="q4_k_m")
    refitter = Refitter(artifact)
    assert set(refitter.gguf_types.values()) == {"Q4_K", "Q6_K"}
    tensors = nudged(model, 4)
    program = optimize(refitter.config, tensors, refitter.options).program  # a compile of the new weights
    refitted = last_logits(refitter.from_tensors(tensors))
    assert np.array_equal(refitted, last_logits(ReferenceExecutable(program.graph, program.weights)))
    assert not np.array_equal(refitted, last_logits(artifact.executable))


def test_tensor_parallel_ranks_each_take_their_shard_or_none_does(tiny, tmp_path: Path) -> None:
    """TP 2 on the reference backend: rank 0 in this process, rank 1 a spawned worker that receives its
    shard over the step's process group; a shard a worker cannot load leaves every rank on the old."""
    hf, _ = tiny
    artifact = compiled(hf, tmp_path / "a", backend="reference", quantization="none", tensor_parallel_size=2)
    ranks = artifact.executable
    try:
        refitter = Refitter(artifact)
        trained = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
        before = last_logits(ranks)
        staged = refitter.from_tensors(nudged(trained, 4))
        broken = StagedRanks(
            ranks, staged.rank0, [{name: t for name, t in list(staged.shards[0].items())[1:]}]
        )
        with pytest.raises(BackendError, match=r"rank\(s\) \[1\] could not load the new weights"):
            broken.commit()
        assert np.array_equal(last_logits(ranks), before)
        assert staged.commit() is ranks
        with torch.no_grad():
            expected = trained(torch.tensor([PROMPT])).logits[0, -1].numpy()
        assert np.abs(last_logits(ranks) - expected).max() / np.abs(expected).max() < 1e-5
    finally:
        ranks.close()
