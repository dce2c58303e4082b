"""The `kiln` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, UsageError


def _pull(args: argparse.Namespace) -> int:
    from kiln.frontend.pull import pull

    path = pull(args.model, progress=lambda line: print(line, file=sys.stderr))
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.compiler import ModelOptions
    from kiln.llm import LLM
    from kiln.runtime.engine_options import EngineOptions
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.serve_command import torchrun_worker

    if torchrun_worker(args):
        return 0
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop or [],
    )
    images = [_read_image(path) for path in args.image or []]
    llm = LLM.from_options(ModelOptions.from_args(args), EngineOptions.from_args(args))
    prompt: Any = args.prompt
    if args.chat:
        parts = [{"type": "image_pil", "image_pil": image} for image in images]
        content = [*parts, {"type": "text", "text": args.prompt}] if images else args.prompt
        prompt = llm.chat_prompt([{"role": "user", "content": content}])
    elif images:  # the prompt holds the model's placeholder once an image
        prompt = {"prompt": args.prompt, "multi_modal_data": {"image": images}}
    engine_prompt, embedded = llm.engine_prompt(prompt)
    engine = llm.engine
    engine.add_request("generate", engine_prompt, params, images=embedded)
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.outputs[0].delta_text, end="", flush=True)
    print()
    llm.close()
    return 0


def _read_image(path: str) -> Any:
    """An --image file, decoded within the server's limits (bytes, pixels)."""
    from kiln.runtime.media import MediaError, MediaPolicy, decode_image

    try:
        return decode_image(Path(path).read_bytes(), MediaPolicy())
    except (OSError, MediaError) as error:
        raise UsageError(f"--image {path}: {error}") from None


def _compile(args: argparse.Namespace) -> int:
    import json
    from contextlib import nullcontext

    from kiln.backends.base import DeviceRequiredError
    from kiln.compiler import (
        CompileLimits,
        ModelOptions,
        OutputError,
        check_output,
        compile_model,
        compile_stages,
        resolve,
    )
    from kiln.console import stage_progress

    plan = resolve(ModelOptions.from_args(args))
    targets = plan.targets
    try:
        check_output(Path(args.output), args.force)
    except OutputError as error:
        raise UsageError(str(error), hint=error.hint) from None
    limits = CompileLimits(args.max_model_len, args.max_num_seqs)
    show = not (args.quiet or args.json)
    title = (
        f"kiln: compiling {args.model} for {plan.backend} {', '.join(t.name for t in targets)} "
        f"({plan.reason}) into {args.output}"
    )
    try:
        with stage_progress(title, compile_stages(targets)) if show else nullcontext() as progress:
            result = compile_model(plan, Path(args.output), limits, progress, args.force)
    except DeviceRequiredError as error:
        written = ", ".join(error.written) or "nothing"
        raise UsageError(f"{error} (kept for a builder that has one: {written})", hint=error.hint) from None
    manifest = result.manifest
    summary = {
        "artifact": str(result.path),
        "model": manifest["model"]["name"],
        "targets": {
            name: {
                "backend": e["backend"],
                "backend_version": e["backend_version"],
                "kernels": e.get("kernels", {}),
            }
            for name, e in manifest["targets"].items()
        },
        "seconds": {k: round(v, 3) for k, v in result.stage_seconds.items()},
        "bytes": result.total_bytes(),
        "files": len(manifest["files"]),
        "peak_rss_bytes": _peak_rss_bytes(),
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    elif not args.quiet:
        width = max(len(name) for name in ["target", *manifest["targets"]]) + 2
        print(f"{'target':<{width}}{'backend':<12}{'version':<18}files")
        for name, entry in manifest["targets"].items():
            code = ", ".join(entry["code"])
            print(f"{name:<{width}}{entry['backend']:<12}{entry['backend_version']:<18}{code}")
        for name, entry in manifest["targets"].items():
            origins: dict[str, list[str]] = {}
            for kernel, origin in entry.get("kernels", {}).items():
                origins.setdefault(origin, []).append(kernel)
            for origin, names in sorted(origins.items()):
                print(f"  {name} kernels {origin} ({len(names)}): {', '.join(sorted(names))}")
        total = sum(result.stage_seconds.values())
        print(
            f"wrote {result.path} ({summary['bytes']:,} bytes, {summary['files']} files) in {total:.1f} s, "
            f"peak memory {summary['peak_rss_bytes'] / 2**20:,.0f} MiB"
        )
    return 0


def _peak_rss_bytes() -> int:
    """The most memory this process has held resident so far. Linux's VmHWM is this program's own;
    ru_maxrss (the fallback elsewhere) also counts the process that started it, since exec keeps the
    high-water mark of the address space it replaced (a test worker's, a shell's)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _by_type(totals: dict[str, int]) -> str:
    return ", ".join(f"{kind} {size / 2**20:,.1f} MiB" for kind, size in totals.items())


def _tune(args: argparse.Namespace) -> int:
    from kiln.compiler import ModelOptions, resolve
    from kiln.compiler.build import build_program

    plan = resolve(ModelOptions.from_args(args))
    if len(plan.targets) != 1 or plan.targets[0].kind != "cpu":
        raise UsageError(f"kiln tune tunes one CPU target (cpu or cpu:<mcpu>), got {args.target!r}")
    if args.trials < 1:
        raise UsageError(f"--trials must be at least 1, got {args.trials}")
    from kiln.backends.tvm import cpu
    from kiln.backends.tvm.tuning import decode_workloads, target_folder, tune_workload

    logs = plan.tuning_logs
    if logs is None:
        raise UsageError("kiln tune writes tuning logs: --tuning-logs names the folder (or leave it unset)")
    built = build_program(args.model, plan.pipeline())
    program, source = built.program, built.source
    llvm = cpu.llvm_target(plan.targets[0], args.num_threads)
    workloads = decode_workloads(program.graph, llvm)
    print(
        f"tuning {len(workloads)} kernels of {source.name}'s decode function for {target_folder(llvm)}, "
        f"{args.trials} trials each, into {logs / target_folder(llvm)}",
        file=sys.stderr,
    )
    kept = 0
    for index, workload in enumerate(workloads, 1):
        meta = tune_workload(workload, llvm, logs, args.trials)
        tuned = "none" if meta["tuned_us"] is None else f"{meta['tuned_us']:.2f} us"
        verdict = "kept" if meta["kept"] else "not kept (the template is faster)"
        kept += bool(meta["kept"])
        print(
            f"[{index}/{len(workloads)}] {workload.kind} {workload.digest[:16]} {tuple(workload.key)}: "
            f"tuned {tuned}, templated {meta['templated_us']:.2f} us, {verdict} "
            f"({meta['tune_seconds']:.0f} s)",
            flush=True,
        )
    print(f"{kept} of {len(workloads)} kernels tuned faster than their template; logs in {logs}")
    return 0


def _bundle(args: argparse.Namespace) -> int:
    from kiln.bundle import make_bundle

    bundle = make_bundle(
        Path(args.artifact),
        args.target,
        Path(args.output),
        tvm_wheel=Path(args.tvm_wheel) if args.tvm_wheel else None,
    )
    print(
        f"wrote {bundle.path}: {bundle.target} ({bundle.host_triple}), {sum(bundle.sizes.values()):,} bytes"
    )
    for part, size in bundle.sizes.items():
        print(f"  {part:<18}{size:>14,}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    import numpy as np

    from kiln.runtime.artifact import (
        check_structure,
        load_artifact,
        probe_logits,
        read_manifest,
        runnable_target,
    )

    if runnable_target(read_manifest(Path(args.artifact)), args.target) is None:
        lines, reasons = check_structure(Path(args.artifact), args.target)
        for line in lines:
            print(f"  {line}")
        print(
            f"ok (structure only): {args.artifact}: checksums, schema, backend version and compiled code "
            f"check out; did NOT run the probe, since no target fits this machine ({'; '.join(reasons)})"
        )
        return 0
    artifact = load_artifact(Path(args.artifact), target=args.target)
    now, recorded = probe_logits(artifact)
    if recorded is None:
        finite = bool(np.isfinite(now).all())
        print(
            f"{'ok' if finite else 'kiln: verify failed'}: {artifact.path} ({artifact.target.name}): ran the "
            f"probe ({'finite' if finite else 'NON-FINITE'} logits); no compile-time logits to compare with "
            "(it was compiled on a machine that could not run it)"
        )
        return 0 if finite else 1
    error = float(np.abs(now - recorded).max() / np.abs(recorded).max())
    tolerance = float(artifact.target_entry["probe"]["tolerance"])
    if error > tolerance:
        print(
            f"kiln: verify failed: probe logits differ by {error:.3g} (tolerance {tolerance:g})",
            file=sys.stderr,
        )
        return 1
    print(
        f"ok: {artifact.path} ({artifact.target.name}): checksums, schema and backend version match; "
        f"probe logits within {error:.3g} of compile time (tolerance {tolerance:g})"
    )
    return 0


def _inspect_artifact(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kiln.ir import graph_from_json, print_graph
    from kiln.runtime.artifact import read_manifest, safetensors_bytes_by_dtype

    folder = Path(args.model)
    manifest = read_manifest(folder)
    model = manifest["model"]
    print(f"artifact {folder}: schema {manifest['schema_version']}, kiln {manifest['kiln_version']}")
    print(f"model: {model['name']} ({model['architecture']}), source sha256 {model['source_sha256'][:16]}…")
    print(
        "compile: " + ", ".join(f"{k} {v}" for k, v in sorted(manifest["compile"].items()) if k != "passes")
    )
    print("passes: " + ", ".join(manifest["compile"]["passes"]))
    print(f"limits: {manifest['limits']}")
    for name, entry in manifest["targets"].items():
        print(
            f"target {name}: {entry['backend']} {entry['backend_version']}, gpu arch {entry['gpu_arch']}, "
            f"code {entry['code']}, weights {entry['weights']}"
        )
    size = sum((folder / f).stat().st_size for f in manifest["files"])
    print(f"{len(manifest['files'])} files, {size:,} bytes")
    for weights in sorted({entry["weights"] for entry in manifest["targets"].values()}):
        print(f"weights {weights} by storage dtype: {_by_type(safetensors_bytes_by_dtype(folder / weights))}")
    if args.ir:
        with_ir = [e for e in manifest["targets"].values() if (folder / e["folder"] / "graph.json").is_file()]
        if not with_ir:
            backends = ", ".join(sorted({e["backend"] for e in manifest["targets"].values()}))
            raise UsageError(
                f"{folder} holds compiled code ({backends}), not the IR graph",
                hint="`kiln inspect MODEL --ir --opt-level 2` prints the graph a model compiles from",
            )
        graph = graph_from_json(json.loads((folder / with_ir[0]["folder"] / "graph.json").read_text()))
        print(print_graph(graph), end="")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kiln.runtime.artifact import is_artifact

    if is_artifact(Path(args.model)):
        return _inspect_artifact(args)
    from kiln.compiler import ModelOptions, resolve
    from kiln.compiler.build import build_program
    from kiln.frontend.gguf_header import bytes_by_type
    from kiln.frontend.pull import resolve_model
    from kiln.ir import print_graph
    from kiln.passes.cost import matmul_flops
    from kiln.passes.memory_plan import plan_memory

    plan = resolve(ModelOptions.from_args(args))
    built = build_program(args.model, plan.pipeline())  # weights stay deferred: nothing is read
    config = built.config
    print(f"model: {built.source.name} ({config.architecture})")
    print(
        f"layers {config.num_hidden_layers}, hidden {config.hidden_size}, heads {config.num_attention_heads}"
        f"/{config.num_key_value_heads} kv, head_dim {config.head_dim}, vocab {config.vocab_size}, "
        f"tied {config.tie_word_embeddings}, sliding_window {config.sliding_window}"
    )
    if config.num_experts:
        moe_layers = sum(config.is_moe(layer) for layer in range(config.num_hidden_layers))
        print(
            f"experts {config.num_experts}, {config.num_experts_per_tok} a token "
            f"({'renormalised' if config.norm_topk_prob else 'not renormalised'}), each "
            f"{config.expert_intermediate_size} wide, in {moe_layers} of {config.num_hidden_layers} layers"
        )
    if args.ir:
        print(print_graph(built.program.graph), end="")
    before, after = built.captured, built.program
    print(f"pipeline O{args.opt_level}, quantization {plan.quantization or 'none'}, dtype {plan.dtype}")
    print(built.report.table())
    print(
        f"nodes {len(before.graph.nodes)} -> {len(after.graph.nodes)}; "
        f"weight bytes {before.weight_bytes():,} -> {after.weight_bytes():,}"
    )
    source = resolve_model(args.model)
    if source.is_file():
        print(f"GGUF weights by type: {_by_type(bytes_by_type(source))}")
    print("ops after: " + ", ".join(f"{op} {n}" for op, n in sorted(after.graph.op_counts().items())))
    sizes = {
        "T": args.plan_tokens,
        "B": 1,
        "B1": 2,
        "L": 1,
        "MB": -(-args.plan_tokens // 16),
        "NB": 1,
        "BS": 16,
    }
    plan = plan_memory(after.graph, sizes)
    print(
        f"activations of a {args.plan_tokens}-token prefill: peak {plan.peak_live_bytes:,} bytes live, "
        f"{len(plan.buffer_bytes)} buffers of {plan.planned_bytes:,} bytes planned"
    )
    decode = {"T": 1, "B": 1, "B1": 2, "L": 1, "MB": 1, "NB": 1, "BS": 16}
    for name, graph in (("captured", before.graph), ("after pipeline", after.graph)):
        per_token = matmul_flops(graph, decode, context=args.plan_tokens)
        prefill = matmul_flops(graph, sizes, context=args.plan_tokens // 2)  # keys seen per query, on average
        print(
            f"matmul FLOPs, {name}: {per_token:,} per decode token at context {args.plan_tokens}; "
            f"{prefill:,} for a {args.plan_tokens}-token prefill"
        )
    if args.weights:
        from kiln.compiler.weight_formats import artifact_rows, checkpoint_rows, table

        stored, held = checkpoint_rows(built), artifact_rows(built)
        print(f"model file tensors ({len(stored)}): name, shape, how the file stores it")
        print(table(stored))
        print(f"artifact tensors ({len(held)}): name, shape, how the artifact holds it")
        print(table(held))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kiln.compiler.options import add_arguments
    from kiln.runtime.engine_options import add_engine_arguments
    from kiln.runtime.scheduler import DEFAULT_MAX_NUM_SEQS
    from kiln.serve_command import add_serve_command

    parser = argparse.ArgumentParser(prog="kiln", description="Compile LLMs ahead of time; run them.")
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="fetch a known model into the cache ($KILN_HOME)")
    pull.add_argument("model", help="a known model name, e.g. smollm2-135m-instruct")
    pull.set_defaults(run=_pull)

    generate = commands.add_parser("generate", help="generate from one prompt (compiled for this host)")
    generate.add_argument("model", help="a known model name, a .gguf file or a HF model directory")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument(
        "--image",
        action="append",
        help="an image file for a vision-language model (repeatable): with --chat each goes before the "
        "prompt's text; without, the prompt holds the model's placeholder (e.g. <image>) once an image",
    )
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    add_arguments(generate, "generate")
    add_engine_arguments(generate, "generate")
    generate.set_defaults(run=_generate)

    add_serve_command(commands)

    compile_ = commands.add_parser("compile", help="compile a model ahead of time into an artifact folder")
    compile_.add_argument("model", help="a known model name, a .gguf file or a HF model directory")
    add_arguments(compile_, "compile")
    compile_.add_argument("--max-model-len", type=int, default=None)
    compile_.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    compile_.add_argument(
        "-o",
        "--output",
        required=True,
        help="the artifact folder to write; it must be absent, empty or a kiln artifact (or --force)",
    )
    compile_.add_argument(
        "--force", action="store_true", help="replace OUTPUT even when it is not a kiln artifact"
    )
    compile_.add_argument("--quiet", action="store_true", help="print nothing but errors")
    compile_.add_argument("--json", action="store_true", help="print a JSON summary (for CI logs)")
    compile_.set_defaults(run=_compile)

    tune = commands.add_parser(
        "tune", help="tune the TVM CPU decode kernels with MetaSchedule into tuning logs (for compile)"
    )
    tune.add_argument("model", help="a known model name, a .gguf file or a HF model directory")
    tune.add_argument("--trials", type=int, default=32, help="MetaSchedule trials per kernel (default 32)")
    add_arguments(tune, "tune")
    tune.set_defaults(run=_tune, backend="tvm", target="cpu", quantization="none")

    verify = commands.add_parser("verify", help="check an artifact: checksums, schema, load, probe logits")
    verify.add_argument("artifact")
    verify.add_argument("--target", default=None, help="which of its targets (default: the first that fits)")
    verify.set_defaults(run=_verify)

    bundle = commands.add_parser(
        "bundle", help="one target of an artifact plus the TVM runtime and kiln, to copy to a device"
    )
    bundle.add_argument("artifact")
    bundle.add_argument("--target", required=True, help="which of its targets, e.g. cuda:sm_87")
    bundle.add_argument("-o", "--output", required=True, help="a new folder for the bundle")
    bundle.add_argument(
        "--tvm-wheel", default=None, help="apache-tvm wheel for the device's machine (default: pip download)"
    )
    bundle.set_defaults(run=_bundle)

    inspect = commands.add_parser("inspect", help="describe a model or an artifact; --ir prints the IR")
    inspect.add_argument("model")
    inspect.add_argument("--ir", action="store_true", help="print the IR after the pipeline")
    inspect.add_argument(
        "--weights",
        action="store_true",
        help="list every tensor: how the model file stores it, and how the artifact would hold it",
    )
    add_arguments(inspect, "inspect")
    inspect.add_argument("--plan-tokens", type=int, default=512, help="prefill size for the memory plan")
    inspect.set_defaults(run=_inspect, backend="reference", opt_level=0, quantization="none")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as error:
        print(f"kiln: error: {error.one_line()}", file=sys.stderr)
        return 2
    except KilnError as error:
        print(f"kiln: error: {error.one_line()}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"kiln: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
