"""The `kiln` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError, UsageError
from kiln.runtime.pooling import POOLING_TYPES
from kiln.runtime.scheduler import SCHEDULING_POLICIES
from kiln.server.reasoning import REASONING_PARSERS
from kiln.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from kiln.server.router import ModelEntry


def _pull(args: argparse.Namespace) -> int:
    from kiln.frontend.pull import pull

    path = pull(args.model, progress=lambda line: print(line, file=sys.stderr))
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    if _torchrun_worker(args):
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
    llm = LLM(args.model, max_model_len=args.max_model_len, **_model_options(args))
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


def _media_limits(args: argparse.Namespace) -> Any:
    """--allowed-local-media-path, --allowed-media-domains and --limit-mm-per-prompt as the server's."""
    import json

    from kiln.runtime.media import MediaPolicy
    from kiln.server.serving_engine import DEFAULT_MAX_IMAGES, MediaLimits

    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise UsageError(f"--allowed-local-media-path {local}: not a directory")
    limit = DEFAULT_MAX_IMAGES
    if args.limit_mm_per_prompt is not None:
        try:
            limits = json.loads(args.limit_mm_per_prompt)
        except json.JSONDecodeError as error:
            raise UsageError(f"--limit-mm-per-prompt: not JSON ({error}); e.g. '{{\"image\": 4}}'") from None
        if not isinstance(limits, dict) or set(limits) - {"image"}:
            raise UsageError('--limit-mm-per-prompt takes {"image": N} (images are the one modality)')
        limit = limits.get("image", limit)
        if not isinstance(limit, int) or limit < 0:
            raise UsageError(f"--limit-mm-per-prompt: image must be a count >= 0, got {limit!r}")
    policy = MediaPolicy(
        allowed_local_media_path=Path(local).resolve() if local is not None else None,
        allowed_media_domains=frozenset(args.allowed_media_domains or ()),
    )
    return MediaLimits(policy, limit)


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_UNITS |= {f"{unit}ib": 2 ** (10 * power) for power, unit in enumerate("kmgt", 1)}
_SIZE_UNITS |= {f"{unit}b": value for unit, value in list(_SIZE_UNITS.items()) if len(unit) == 1}


def parse_size(text: str) -> int:
    """Bytes from `20GiB`, `512MiB`, `2G` (powers of 1000) or a plain number."""
    number = text.strip().lower()
    unit = number.lstrip("0123456789.")
    value = number[: len(number) - len(unit)]
    if unit.strip() not in _SIZE_UNITS or not value:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with KiB, MiB, GiB"
        )
    return int(float(value) * _SIZE_UNITS[unit.strip()])


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options given on the command line, as `kiln.LLM` keywords (validated here, at once)."""
    from kiln.compiler import ModelOptions

    options = ModelOptions.from_args(args)
    return {name: getattr(options, name) for name in vars(options) if name != "model"}


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun, ranks 1.. run their shard of the artifact until rank 0 stops (True); rank 0 and
    a process torchrun did not start go on (False)."""
    from kiln.runtime.artifact import run_artifact_rank
    from kiln.runtime.tensor_parallel import torchrun_rank

    launch = torchrun_rank()
    if launch is None or launch[0] == 0:
        return False
    run_artifact_rank(Path(args.model), args.target)
    return True


def _serve(args: argparse.Namespace) -> int:
    import logging

    from kiln.llm import LLM, describe
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.server.run import run_server

    several = _several_models(args)
    if several is None and _torchrun_worker(args):
        return 0

    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError(
            f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})"
        )
    if several is not None:
        return _serve_several(args, several)
    logging.basicConfig(level=logging.WARNING, format="kiln: %(levelname)s %(name)s: %(message)s")
    llm = LLM(
        args.model,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        **_model_options(args),
        **_engine_sizes(args),
    )
    engine = llm.engine
    _load_lora_modules(llm, args)
    print(
        f"kiln: serving {llm.artifact.model_name} as {args.served_model_name or args.model} on "
        f"http://{args.host}:{args.port} ({describe(llm.artifact)}; max_model_len {engine.max_model_len:,}, "
        f"max_num_seqs {engine.scheduler.config.max_num_seqs}; KV cache {llm.kv_cache})",
        file=sys.stderr,
        flush=True,
    )
    run_server(
        AsyncEngine(llm.engine),
        served_model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        log_level=args.uvicorn_log_level,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        auto_tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
        media=_media_limits(args),
        allow_lora_updates=args.allow_runtime_lora_updating,
        weights=_weight_source(llm) if args.enable_weight_updates else None,
    )
    llm.close()
    return 0


def _engine_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's limits (and embeddings' pooling) given on the command line, as `kiln.LLM` keywords."""
    sizes = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_step_ms": args.max_step_ms,
        "kv_cache_memory": args.kv_cache_memory,
        "num_blocks": args.num_kv_blocks,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "kv_offload_dir": args.kv_offload_dir,
        "kv_offload_size": args.kv_offload_size,
        "kv_offload_cpu_size": args.kv_offload_cpu_size,
        "pooling": args.pooling,
    }
    return {name: value for name, value in sizes.items() if value is not None}


def model_entries(texts: list[str]) -> list[ModelEntry]:
    """`kiln serve`'s MODEL arguments as the models they serve: `NAME=MODEL` names one; a known model is
    named by its name, a file by its stem, a folder by its name; a folder holding artifact folders serves
    each of them. A UsageError for a model that is not there or a name given twice."""
    entries: list[ModelEntry] = []
    for text in texts:
        entries += _entries_of(text)
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise UsageError(f"two models are served as {entry.name!r}: name one of them with NAME=MODEL")
        seen.add(entry.name)
    return entries


def _entries_of(text: str) -> list[ModelEntry]:
    from kiln.frontend.pull import KNOWN_MODELS
    from kiln.server.router import ModelEntry

    name, source = None, text
    if "=" in text and not Path(text).expanduser().exists():
        name, _, source = text.partition("=")
        if not name or not source:
            raise UsageError(f"{text!r}: give MODEL or NAME=MODEL")
    path = Path(source).expanduser()
    if not path.exists():
        if source in KNOWN_MODELS:
            return [ModelEntry(name or source, source)]
        raise UsageError(
            f"{source}: no such model file or directory, and not a known model name",
            hint=f"known models: {', '.join(KNOWN_MODELS)}",
        )
    artifacts = artifact_folders(path)
    if artifacts and name is not None:
        raise UsageError(f"{text!r}: {source} holds several artifact folders; name them one by one")
    if artifacts:
        return [ModelEntry(folder.name, str(folder)) for folder in artifacts]
    return [ModelEntry(name or (path.stem if path.is_file() else path.resolve().name), source)]


def artifact_folders(path: Path) -> list[Path]:
    """The artifact folders a folder holds (none for an artifact, a file or a model's own folder)."""
    from kiln.runtime.artifact import is_artifact

    if not path.is_dir() or is_artifact(path):
        return []
    return sorted(child for child in path.iterdir() if is_artifact(child))


def _several_models(args: argparse.Namespace) -> list[ModelEntry] | None:
    """The models of `kiln serve A B ...` (server/router.py's ModelEntry); None for one model, whose
    args.model (and --served-model-name, from NAME=MODEL) become that model's, as one model is served."""
    (text, *more) = args.model
    named = "=" in text and not Path(text).expanduser().exists()
    several = more or named or artifact_folders(Path(text).expanduser())
    entries = model_entries(args.model) if several else []
    if len(entries) > 1:
        return entries
    if args.max_loaded_models is not None:
        raise UsageError("--max-loaded-models applies to a server of several models")
    if entries:
        (entry,) = entries
        if named and args.served_model_name is not None:
            raise UsageError(f"{text!r} names the model already: give NAME=MODEL or --served-model-name")
        args.served_model_name = args.served_model_name or entry.name
        text = entry.source
    args.model = text
    return None


def _serve_several(args: argparse.Namespace, entries: list[ModelEntry]) -> int:
    """Serve several models from one port, each loaded on its first request (server/router.py)."""
    import logging

    from kiln.runtime.tensor_parallel import torchrun_rank
    from kiln.server.body_limit import default_max_request_bytes
    from kiln.server.router import ModelRouter
    from kiln.server.run import run_router

    refused = {
        "--served-model-name": args.served_model_name is not None,
        "--lora-modules": bool(args.lora_modules),
        "--allow-runtime-lora-updating": args.allow_runtime_lora_updating,
        "--enable-weight-updates": args.enable_weight_updates,
        "torchrun": torchrun_rank() is not None,
    }
    for flag, given in refused.items():
        if given:
            raise UsageError(
                f"{flag} serves one model; this server serves several",
                hint="name each model with NAME=MODEL" if flag == "--served-model-name" else None,
            )
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise UsageError(f"--max-loaded-models must be at least 1, got {args.max_loaded_models}")
    logging.basicConfig(level=logging.WARNING, format="kiln: %(levelname)s %(name)s: %(message)s")
    router = ModelRouter(entries, _model_loader(args), max_loaded_models=args.max_loaded_models)
    bound = f"at most {args.max_loaded_models} loaded at once" if args.max_loaded_models else "no bound"
    print(
        f"kiln: serving {len(entries)} models on http://{args.host}:{args.port}: "
        f"{', '.join(f'{e.name} ({e.source})' for e in entries)}; each loads on its first request ({bound})",
        file=sys.stderr,
        flush=True,
    )
    run_router(
        router,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        log_level=args.uvicorn_log_level,
        max_request_bytes=args.max_request_bytes or default_max_request_bytes(args.max_model_len or 0),
        shutdown_timeout=args.shutdown_timeout,
    )
    return 0


def _model_loader(args: argparse.Namespace) -> Any:
    """How the router loads one of its models: as `kiln serve MODEL` loads its one, with the same flags."""
    options = _model_options(args)  # checked now, before any model loads
    media = _media_limits(args)
    sizes = _engine_sizes(args)

    def load(entry: Any) -> Any:
        from kiln.llm import LLM, describe
        from kiln.runtime.async_engine import AsyncEngine
        from kiln.server.app import create_app
        from kiln.server.router import ServedModel

        llm = LLM(
            entry.source,
            max_model_len=args.max_model_len,
            scheduling_policy=args.scheduling_policy,
            **options,
            **sizes,
        )
        engine = AsyncEngine(llm.engine)

        def close() -> None:
            engine.shutdown()
            llm.close()

        try:
            app = create_app(
                engine,
                entry.name,
                None,  # the router checks the API key
                args.max_waiting,
                max_request_bytes=args.max_request_bytes,
                auto_tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                reasoning_parser=args.reasoning_parser,
                media=media,
            )
        except BaseException:
            close()
            raise
        print(
            f"kiln: {entry.name} is {llm.artifact.model_name} ({describe(llm.artifact)}; max_model_len "
            f"{engine.max_model_len:,}, max_num_seqs {llm.engine.scheduler.config.max_num_seqs}; "
            f"KV cache {llm.kv_cache})",
            file=sys.stderr,
            flush=True,
        )
        return ServedModel(app, engine, close)

    return load


def _weight_source(llm: Any) -> Any:
    """Where a server with --enable-weight-updates gets new weights (refused up front where it cannot);
    the pipeline it needs is imported on the first update."""
    from kiln.runtime.live_weights import OnFirstUse, WeightUpdateError, check_refittable

    try:
        check_refittable(llm.artifact.manifest, llm.artifact.target_entry)
    except WeightUpdateError as error:
        raise UsageError(f"--enable-weight-updates: {error}", hint=error.hint) from None

    def refitter() -> Any:
        from kiln.compiler.refit import Refitter

        return Refitter(llm.artifact)

    return OnFirstUse(refitter)


def _load_lora_modules(llm: Any, args: argparse.Namespace) -> None:
    """--lora-modules NAME=PATH ... (or vLLM's JSON form {"name": ..., "path": ...}), read and checked now."""
    import json

    from kiln.runtime.lora import LoRAError, LoRARequest

    modules = args.lora_modules or []
    if (modules or args.allow_runtime_lora_updating) and not llm.serves_lora:
        flag = "--lora-modules" if modules else "--allow-runtime-lora-updating"
        raise UsageError(f"{flag} needs --enable-lora")
    for index, module in enumerate(modules, start=1):
        if module.lstrip().startswith("{"):
            entry = json.loads(module)
            name, path = entry.get("name"), entry.get("path")
        else:
            name, _, path = module.partition("=")
        if not name or not path:
            raise UsageError(f'--lora-modules {module!r}: give NAME=PATH or {{"name": ..., "path": ...}}')
        try:
            llm.engine.add_lora(LoRARequest(name, index, path))
        except LoRAError as error:
            raise UsageError(f"--lora-modules {name}: {error}", hint=error.hint) from None


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
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kiln.compiler.options import add_arguments

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
    generate.add_argument("--max-model-len", type=int, default=None)
    add_arguments(generate, "generate")
    generate.set_defaults(run=_generate)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model",
        nargs="+",
        metavar="MODEL",
        help="a known model name, a .gguf file, a HF model directory or an artifact folder; several (or a "
        "folder of artifact folders) are served from one port, each under its name (NAME=MODEL names it; "
        "default: the known name, or the file's or folder's name) and loaded on its first request",
    )
    serve.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="with several models, keep at most N loaded: loading another unloads the least recently used "
        "idle one (default: no limit)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on the API")
    serve.add_argument(
        "--served-model-name", default=None, help="the name clients send as `model` (default: MODEL)"
    )
    add_arguments(serve, "serve")
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="tokens per sequence (default: min(model's, 8192))"
    )
    serve.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (default 16)")
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per step (default 512)"
    )
    serve.add_argument(
        "--max-step-ms",
        type=float,
        default=None,
        help="while streams decode, add only as many prompt tokens to a step as keep it under this many "
        "milliseconds, by the step times measured so far (default: twice the decode rows' own step)",
    )
    serve.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs (default): in arrival order; priority: by each request's `priority` (smaller first), "
        "then arrival",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="the KV cache's size in bytes (default: max-num-seqs full-length sequences, at most half "
        "of the memory available)",
    )
    serve.add_argument(
        "--num-kv-blocks", type=int, default=None, help="the KV cache's size in blocks of 16 tokens"
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 when more than this many sequences would wait (default: no limit)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="answer 413 for a larger request body (default: 16 MiB, or 64 bytes a token of max-model-len)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds requests in flight may take to finish before they are cut (default 30)",
    )
    serve.add_argument("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto", the default with tools)',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json, mistral, pythonic",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the reply's <think>...</think> into reasoning_content: deepseek_r1, qwen3",
    )
    serve.add_argument(
        "--pooling",
        choices=POOLING_TYPES,
        default=None,
        help="how /v1/embeddings pools the final hidden states: last (token) or mean (default: the "
        "model's own pooling, else last)",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="let image parts name file:// URLs under this directory (default: none)",
    )
    serve.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="let image parts name http(s) URLs on these hosts (default: none; only data: URLs)",
    )
    serve.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help="the most images one prompt may hold, as JSON: '{\"image\": 4}' (default 8)",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served under their names (PEFT folders or llama.cpp LoRA .gguf files; with "
        "--enable-lora); a request's `model` picks one",
    )
    serve.add_argument(
        "--max-loras", type=int, default=None, help="LoRA adapters one batch can mix (default 4)"
    )
    serve.add_argument("--max-lora-rank", type=int, default=None, help="the largest LoRA rank (default 16)")
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora)",
    )
    serve.add_argument(
        "--kv-offload-dir",
        default=None,
        help="keep prefix-cache blocks in this folder too: a restarted server (or another server of the "
        "same artifact sharing it) loads them back instead of recomputing (docs/runtime.md)",
    )
    serve.add_argument(
        "--kv-offload-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="the most the folder's blocks take, e.g. 20GiB (default: 16 GiB or half the disk's free space)",
    )
    serve.add_argument(
        "--kv-offload-cpu-size",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="host RAM that keeps blocks the KV cache evicts (for a KV cache on a GPU), e.g. 8GiB",
    )
    serve.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve POST /update_weights_from_disk, /init_weight_transfer_engine, /update_weights, /pause, "
        "/resume, /sleep and /wake_up: new weights without a recompile (docs/weight-updates.md)",
    )
    serve.set_defaults(run=_serve)

    compile_ = commands.add_parser("compile", help="compile a model ahead of time into an artifact folder")
    compile_.add_argument("model", help="a known model name, a .gguf file or a HF model directory")
    add_arguments(compile_, "compile")
    compile_.add_argument("--max-model-len", type=int, default=None)
    compile_.add_argument("--max-num-seqs", type=int, default=16)
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
