"""Bundle what a GPU machine needs to check kiln's CUDA code, and the check itself.

    python scripts/gpu_bundle.py bundle OUT [--arch sm_90]   (here, no GPU needed: nvcc + the libcuda stub)
    python scripts/gpu_bundle.py check OUT                   (on the GPU box; scripts/gpu_check.sh wraps it)

The bundle holds no weights: both sides make the same SmolLM2-135M-shaped float32 weights from a fixed
seed (config-only program: SmolLM2's config, random weights), so it stays small (a few MB):

    OUT/bundle.json            model config, seed, arch, the build's figures, the 8B weights' shapes
    OUT/graphs/step.so|json    float32, decode steps replayed as CUDA graphs (step.json cuda_graph.enabled)
    OUT/nographs/step.so|json  the same, graphs off
    OUT/int4/step.so|json      the same weights quantized int4 (groups of 32), graphs on
    OUT/fp8kv/step.so|json     float32 with a float8 e4m3 KV cache (scales calibrated here and again
                               on the box from the same seed), graphs on
    OUT/llama8b/step.so|json   a Llama-3-8B-shaped model in float16 (built from meta tensors), graphs on;
                               the GPU box makes its 16 GB of random weights on the GPU

Assumptions on the GPU box: this repo checked out (kiln importable: `pip install -e .` or PYTHONPATH
at its parent with the folder named kiln), Python with torch (CUDA build), apache-tvm==0.27.0.post1 and
apache-tvm-ffi==0.1.14.post1 (the runtime libs libtvm_runtime.so and libtvm_runtime_cuda.so come from that
wheel), an NVIDIA driver for CUDA 13 (>= 580) and libcudart.so.13 on the library path.

The check, per build: logits of the CUDA step vs kiln's reference interpreter on the same program
(float32, on the CPU; int4: the quantized program, so the same dequantized weights) for a prefill of
two sequences and three decode steps (max |diff| / max |ref| <= TOLERANCE; replayed graphs must not
change logits already returned), then decode tokens/s at batch 1, 16, 64, next to the HBM floor
(weight bytes per step / bandwidth). The KV cache is allocated on the GPU, as the engine does.

The 8B build has no reference on the box (float32 on the CPU would take 32 GB and minutes): its check is
that `step` (the tiled GEMM linears) and `decode` (the split-K GEMV ones) agree, the last token of a
prefill against the same token decoded after the others (LLAMA_TOLERANCE, float16), then prefill
tokens/s for one 512-token prompt and decode tokens/s at batch 1, 16, 64, with CUDA graphs and
without, as a multiple of the HBM floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SEED = 1234
WEIGHT_SCALE = 0.02
TOLERANCE = 1e-3  # float32 both sides; only the summation order differs
BATCHES = (1, 16, 64)
CONTEXT = 128  # tokens already in each sequence's cache when decode is timed
DECODE_STEPS = 32
BLOCK_SIZE = 16
LLAMA_TOLERANCE = 2e-2  # float16 activations and weights, two kernels' summation orders
PREFILL_TOKENS = 512
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # vendor peak figures

SMOLLM2_135M = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

LLAMA3_8B = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def fail(message: str) -> None:
    print(f"gpu_check: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


# name: (quantization, CUDA graphs, KV cache dtype: None for the float dtype)
BUILDS = {
    "nographs": (None, False, None),
    "graphs": (None, True, None),
    "int4": ("int4", True, None),
    "fp8kv": (None, True, "fp8_e4m3"),
}
PROGRAMS = sorted({(quantization, kv_cache) for quantization, _, kv_cache in BUILDS.values()}, key=str)
FP8_TOLERANCE = 1e-2  # a K/V value near a float8 rounding tie may round the other way (one step, 1/16)


def make_program(
    config_fields: dict[str, Any],
    seed: int,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
) -> Any:
    """SmolLM2-shaped program with seeded random weights, after the O2 passes (as `kiln compile` does)."""
    from kiln.compiler.build import PipelineOptions, optimize
    from kiln.frontend.config import ModelConfig
    from kiln.frontend.models import model_class

    config = ModelConfig(**config_fields)
    with torch.device("meta"):
        shapes = model_class(config)(config).state_dict()
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.randn(t.shape, generator=generator) * WEIGHT_SCALE for name, t in sorted(shapes.items())
    }
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            tensor.add_(1.0)  # norms near 1, as in trained models
    options = PipelineOptions(opt_level=2, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return optimize(config, weights, options).program


def meta_program(config_fields: dict[str, Any], dtype: str) -> Any:
    """`config_fields`' program after the O2 passes in `dtype`; its weights are meta tensors (shapes)."""
    from kiln.compiler.build import PipelineOptions, optimize
    from kiln.frontend.config import ModelConfig
    from kiln.frontend.models import model_class

    config = ModelConfig(**config_fields)
    with torch.device("meta"):
        shapes = model_class(config)(config).state_dict()
    weights = {name: torch.empty(t.shape, device="meta") for name, t in shapes.items()}
    return optimize(config, weights, PipelineOptions(opt_level=2, dtype=dtype)).program


def bundle(out: Path, arch: str) -> None:
    from kiln.backends.base import CompileSettings
    from kiln.backends.targets import Target
    from kiln.backends.tvm.cuda import compile_cuda

    out.mkdir(parents=True, exist_ok=True)
    programs = {key: make_program(SMOLLM2_135M, SEED, *key) for key in PROGRAMS}
    figures = {}
    for name, (quantization, graphs, kv_cache) in BUILDS.items():
        program = programs[(quantization, kv_cache)]
        start = time.perf_counter()
        code = compile_cuda(program, Target("cuda", arch), out / name, CompileSettings(), cuda_graph=graphs)
        figures[name] = {
            "compile_s": round(time.perf_counter() - start, 1),
            "step_so_bytes": (out / name / "step.so").stat().st_size,
            "device_code": code.manifest["device_code"],
            "cuda_graph": code.manifest["cuda_graph"],
        }
        print(f"{name}: {figures[name]}")
    start = time.perf_counter()
    llama = meta_program(LLAMA3_8B, "f16")
    code = compile_cuda(llama, Target("cuda", arch), out / "llama8b", CompileSettings(), cuda_graph=True)
    figures["llama8b"] = {
        "compile_s": round(time.perf_counter() - start, 1),
        "step_so_bytes": (out / "llama8b" / "step.so").stat().st_size,
        "device_code": code.manifest["device_code"],
    }
    print(f"llama8b: {figures['llama8b']}")
    info = {
        "config": SMOLLM2_135M,
        "seed": SEED,
        "weight_scale": WEIGHT_SCALE,
        "arch": arch,
        "build": figures,
        "llama8b": {
            "config": LLAMA3_8B,
            "weights": {name: [list(t.shape), str(t.dtype)[6:]] for name, t in llama.weights.items()},
        },
    }
    (out / "bundle.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"wrote {out} ({total:,} bytes); copy it and the repo to the GPU box, run scripts/gpu_check.sh {out}"
    )


def _load(folder: Path, weights: dict[str, torch.Tensor]) -> Any:
    from kiln.backends.signature_record import read_signature
    from kiln.backends.tvm.executable import TVMExecutable

    description = json.loads((folder / "step.json").read_text())
    if description["device"] != "cuda":
        fail(f"{folder}/step.json is not a CUDA build")
    return TVMExecutable(
        folder / "step.so",
        description["params"],
        weights,
        read_signature(description, folder),
        "cuda",
        cuda_graphs=description["cuda_graph"]["enabled"],
        embed_params=description.get("embed_params"),
    )


def check_logits(executable: Any, program: Any) -> float:
    from kiln.backends.reference import ReferenceExecutable
    from kiln.ir.step import SequenceSlice, build_step_inputs

    reference = ReferenceExecutable(program.graph, program.weights)
    prompts = [
        [1, 17, 300, 4000, 5, 99, 12345, 7, 8],
        [2, 33, 44, 555, 6666, 7777, 10, 11, 12, 13, 14, 15, 16, 17],
    ]
    tables = [[1, 2], [3, 4]]
    host_cache = reference.kv_cache_spec.allocate(8, BLOCK_SIZE)
    device_cache = executable.kv_cache_spec.allocate(8, BLOCK_SIZE, device="cuda")
    worst = 0.0
    steps = [[SequenceSlice(p, 0, t) for p, t in zip(prompts, tables, strict=True)]]  # prefill
    steps += [  # decode: the first is captured as a graph, the next two replay it
        [SequenceSlice([42 + d], len(p) + d, t) for p, t in zip(prompts, tables, strict=True)]
        for d in range(3)
    ]
    returned = []
    for number, slices in enumerate(steps):
        inputs = build_step_inputs(slices, BLOCK_SIZE)
        expected = torch.from_numpy(reference.step(inputs, host_cache))
        got = torch.from_numpy(executable.step(inputs, device_cache))
        if not torch.isfinite(got).all():
            fail(f"step {number}: the CUDA logits are not finite")
        error = float((got - expected).abs().max() / expected.abs().max())
        kind = "prefill" if number == 0 else "decode"
        print(f"  step {number} ({kind}): max |diff| / max |ref| = {error:.3g}")
        worst = max(worst, error)
        returned.append((got, got.clone()))
    if not all(torch.equal(held, kept) for held, kept in returned):
        fail("logits returned earlier changed under a later step (a replay overwrote them)")
    return worst


def decode_tokens_per_s(executable: Any, batch: int) -> float:
    from kiln.ir.step import SequenceSlice, build_step_inputs

    blocks_per_seq = -(-(CONTEXT + DECODE_STEPS + 1) // BLOCK_SIZE)
    cache = executable.kv_cache_spec.allocate(batch * blocks_per_seq + 1, BLOCK_SIZE, device="cuda")
    tables = [list(range(1 + s * blocks_per_seq, 1 + (s + 1) * blocks_per_seq)) for s in range(batch)]
    prefill = [
        SequenceSlice([(s * 7 + i) % 1000 + 1 for i in range(CONTEXT)], 0, tables[s]) for s in range(batch)
    ]
    executable.step(build_step_inputs(prefill, BLOCK_SIZE), cache)
    steps = [
        build_step_inputs([SequenceSlice([5], CONTEXT + i, tables[s]) for s in range(batch)], BLOCK_SIZE)
        for i in range(DECODE_STEPS)
    ]
    executable.step(steps[0], cache)  # warm-up (and CUDA graph capture, if any)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for inputs in steps:
        executable.step(inputs, cache)
    torch.cuda.synchronize()
    return batch * DECODE_STEPS / (time.perf_counter() - start)


def device_weights(shapes: dict[str, list[Any]], seed: int) -> dict[str, torch.Tensor]:
    """Random weights made on the GPU (norms near 1), from the bundle's {name: [shape, dtype]}."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weights = {}
    for name, (shape, dtype) in sorted(shapes.items()):
        tensor = torch.randn(shape, generator=generator, device="cuda", dtype=getattr(torch, dtype))
        weights[name] = tensor.mul_(WEIGHT_SCALE).add_(1.0 if name.endswith("norm.weight") else 0.0)
    return weights


def step_against_decode(executable: Any) -> float:
    """The last token of a 13-token prefill (`step`: 4 row blocks, tiled GEMM linears) against the same
    token decoded after a 12-token prefill (`decode`: one row block, split-K linears)."""
    from kiln.ir.step import SequenceSlice, build_step_inputs

    prompt = [1, 17, 300, 4000, 5, 99, 12345, 7, 8, 100, 2000, 30000, 77]
    first = executable.kv_cache_spec.allocate(4, BLOCK_SIZE, device="cuda")
    whole = torch.from_numpy(
        executable.step(build_step_inputs([SequenceSlice(prompt, 0, [1])], BLOCK_SIZE), first)
    )
    second = executable.kv_cache_spec.allocate(4, BLOCK_SIZE, device="cuda")
    executable.step(build_step_inputs([SequenceSlice(prompt[:-1], 0, [1])], BLOCK_SIZE), second)
    last = executable.step(
        build_step_inputs([SequenceSlice(prompt[-1:], len(prompt) - 1, [1])], BLOCK_SIZE), second
    )
    last = torch.from_numpy(last)
    if not (torch.isfinite(whole).all() and torch.isfinite(last).all()):
        fail("llama8b: logits are not finite")
    return float((whole.float()[-1] - last[-1]).abs().max() / last[-1].abs().max())


def prefill_tokens_per_s(executable: Any) -> float:
    from kiln.ir.step import SequenceSlice, build_step_inputs

    blocks = -(-PREFILL_TOKENS // BLOCK_SIZE)
    cache = executable.kv_cache_spec.allocate(blocks + 1, BLOCK_SIZE, device="cuda")
    tokens = [(i * 31) % 10000 + 1 for i in range(PREFILL_TOKENS)]
    inputs = build_step_inputs([SequenceSlice(tokens, 0, list(range(1, blocks + 1)))], BLOCK_SIZE)
    executable.step(inputs, cache)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    executable.step(inputs, cache)
    torch.cuda.synchronize()
    return PREFILL_TOKENS / (time.perf_counter() - start)


def check_llama8b(out: Path, info: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    shapes = info["llama8b"]["weights"]
    weights = device_weights(shapes, info["seed"])
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"llama8b: {weight_bytes / 1e9:.2f} GB of float16 weights made on the GPU; loading")
    executable = _load(out / "llama8b", weights)
    del weights
    torch.cuda.empty_cache()
    error = step_against_decode(executable)
    print(f"  step (tiled GEMM) vs decode (split-K GEMV): max |diff| / max |logit| = {error:.3g}")
    if error > LLAMA_TOLERANCE:
        fail(f"llama8b: step and decode disagree by {error:.3g} (tolerance {LLAMA_TOLERANCE:g})")
    prefill = prefill_tokens_per_s(executable)
    print(f"  prefill {PREFILL_TOKENS} tokens: {prefill:10.1f} tokens/s")
    floor_s = weight_bytes / bandwidth
    speeds: dict[str, dict[int, float]] = {}
    for graphs in ("graphs", "nographs"):
        if graphs == "nographs" and executable.graphs is not None:
            executable.graphs.enabled = False  # the same code and weights, plain calls
        speeds[graphs] = {batch: decode_tokens_per_s(executable, batch) for batch in BATCHES}
        if graphs == "graphs":
            require_graphs(executable, "llama8b", True)
        for batch, speed in speeds[graphs].items():
            step_s = batch / speed
            print(
                f"  decode {graphs:>8} batch {batch:>3}: {speed:10.1f} tokens/s  ({step_s * 1e3:.2f} ms/step"
                f" = {step_s / floor_s:.2f}x the HBM floor of {floor_s * 1e3:.3f} ms)"
            )
    return {
        "step_vs_decode_error": error,
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": speeds,
        "weight_bytes": weight_bytes,
        "batch1_over_floor": (1 / speeds["graphs"][1]) / floor_s,
    }


def hbm_bandwidth() -> tuple[float, str]:
    name = torch.cuda.get_device_name(0)
    for key, value in HBM_BYTES_PER_S.items():
        if key in name:
            return value, f"{name}: {value / 1e12:.2f} TB/s (vendor peak)"
    return HBM_BYTES_PER_S["H200"], f"{name}: unknown, assuming the H200's 4.8 TB/s"


def require_graphs(executable: Any, name: str, graphs: bool) -> dict[int, int]:
    """The graphs captured per decode bucket; fails where a build with graphs timed plain calls (a capture
    failed, or a batch's bucket has none), so that "graphs" and "no graphs" never time the same thing."""
    if not graphs:
        if executable.graphs is not None:
            fail(f"{name}: built without CUDA graphs, yet the executable captures them")
        return {}
    if executable.graphs is None:
        fail(f"{name}: built with CUDA graphs, but the executable has none (step.json cuda_graph)")
    try:
        for batch in BATCHES:
            executable.graphs.require(batch)
    except RuntimeError as error:
        fail(f"{name}: {error}")
    captured = executable.graphs.captured_buckets()
    print(f"  CUDA graphs captured per decode bucket (rows: graphs): {captured}")
    return captured


def check(out: Path) -> None:
    if not torch.cuda.is_available():
        fail("torch sees no CUDA GPU")
    info = json.loads((out / "bundle.json").read_text())
    major, minor = torch.cuda.get_device_capability(0)
    here = f"sm_{major}{minor}"
    if here != info["arch"]:
        fail(
            f"the bundle is compiled for {info['arch']}, this GPU is {here} ({torch.cuda.get_device_name(0)})"
        )
    programs = {key: make_program(info["config"], info["seed"], *key) for key in PROGRAMS}
    bandwidth, described = hbm_bandwidth()
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "arch": here, "tolerance": TOLERANCE}
    for name, (quantization, graphs, kv_cache) in BUILDS.items():
        if not (out / name).is_dir():
            print(f"{name}: not in this bundle, skipped")
            continue
        program = programs[(quantization, kv_cache)]
        tolerance = FP8_TOLERANCE if kv_cache == "fp8_e4m3" else TOLERANCE
        weights = dict(program.weights)
        weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(f"{name}: loading {out / name / 'step.so'}")
        executable = _load(out / name, weights)
        error = check_logits(executable, program)
        if error > tolerance:
            fail(f"{name}: CUDA logits differ from the reference by {error:.3g} (tolerance {tolerance:g})")
        speeds = {batch: decode_tokens_per_s(executable, batch) for batch in BATCHES}
        captured = require_graphs(executable, name, graphs)
        results[name] = {
            "max_rel_error": error,
            "decode_tokens_per_s": speeds,
            "weight_bytes": weight_bytes,
            "graphs_captured_per_bucket": captured,
        }
        for batch, speed in speeds.items():
            floor_s = weight_bytes / bandwidth
            print(
                f"  decode batch {batch:>3}: {speed:10.1f} tokens/s  ({batch / speed * 1e3:.2f} ms/step; "
                f"HBM floor {floor_s * 1e3:.3f} ms/step = {batch / floor_s:,.0f} tokens/s)"
            )
        del executable
        torch.cuda.empty_cache()
    if (out / "llama8b").is_dir():
        results["llama8b"] = check_llama8b(out, info, bandwidth)
    results["hbm"] = {"bandwidth": described}
    print(f"HBM floors from each build's weight bytes read per decode step; {described}")
    (out / "gpu_check_result.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"gpu_check: OK (logits within {TOLERANCE:g}); results in {out / 'gpu_check_result.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=["bundle", "check"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    if args.mode == "bundle":
        bundle(args.out, args.arch)
    else:
        check(args.out)


if __name__ == "__main__":
    main()
