"""`kiln serve`: one model, or several behind one port (server/router.py), over an OpenAI-compatible HTTP
API. Its flags are the model options (compiler/options.py), the engine options (runtime/engine_options.py)
and the server's own (host, port, API key, limits, tools, media, adapters, weight updates), declared here."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import UsageError
from kiln.runtime.engine_options import EngineOptions, add_engine_arguments
from kiln.server.reasoning import REASONING_PARSERS
from kiln.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from kiln.server.router import ModelEntry


def torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun, ranks 1.. run their shard of the artifact until rank 0 stops (True); rank 0 and
    a process torchrun did not start go on (False). `kiln generate` starts so too."""
    from kiln.runtime.artifact import run_artifact_rank
    from kiln.runtime.tensor_parallel import torchrun_rank

    launch = torchrun_rank()
    if launch is None or launch[0] == 0:
        return False
    run_artifact_rank(Path(args.model), args.target)
    return True


def serve(args: argparse.Namespace) -> int:
    import logging

    from kiln.compiler import ModelOptions
    from kiln.llm import LLM, describe
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.server.run import run_server

    several = _several_models(args)
    if several is None and torchrun_worker(args):
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
    llm = LLM.from_options(ModelOptions.from_args(args), EngineOptions.from_args(args))
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
    from kiln.compiler import ModelOptions

    options = ModelOptions.from_args(args)  # checked now, before any model loads
    media = _media_limits(args)
    engine_options = EngineOptions.from_args(args)

    def load(entry: Any) -> Any:
        from kiln.llm import LLM, describe
        from kiln.runtime.async_engine import AsyncEngine
        from kiln.server.app import create_app
        from kiln.server.router import ServedModel

        llm = LLM.from_options(dataclasses.replace(options, model=entry.source), engine_options)
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


def add_serve_command(commands: Any) -> None:
    """`kiln serve` and its flags, as a command of `commands` (the CLI's subparsers)."""
    from kiln.compiler.options import add_arguments

    parser = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument(
        "model",
        nargs="+",
        metavar="MODEL",
        help="a known model name, a .gguf file, a HF model directory or an artifact folder; several (or a "
        "folder of artifact folders) are served from one port, each under its name (NAME=MODEL names it; "
        "default: the known name, or the file's or folder's name) and loaded on its first request",
    )
    parser.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="with several models, keep at most N loaded: loading another unloads the least recently used "
        "idle one (default: no limit)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on the API")
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send as `model` (default: MODEL)"
    )
    add_arguments(parser, "serve")
    add_engine_arguments(parser, "serve")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="answer 503 when more than this many sequences would wait (default: no limit)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="answer 413 for a larger request body (default: 16 MiB, or 64 bytes a token of max-model-len)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds requests in flight may take to finish before they are cut (default 30)",
    )
    parser.add_argument("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto", the default with tools)',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3), llama3_json, mistral, pythonic",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split the reply's <think>...</think> into reasoning_content: deepseek_r1, qwen3",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="let image parts name file:// URLs under this directory (default: none)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="let image parts name http(s) URLs on these hosts (default: none; only data: URLs)",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        help="the most images one prompt may hold, as JSON: '{\"image\": 4}' (default 8)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served under their names (PEFT folders or llama.cpp LoRA .gguf files; with "
        "--enable-lora); a request's `model` picks one",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora)",
    )
    parser.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve POST /update_weights_from_disk, /init_weight_transfer_engine, /update_weights, /pause, "
        "/resume, /sleep and /wake_up: new weights without a recompile (docs/weight-updates.md)",
    )
    parser.set_defaults(run=serve)
