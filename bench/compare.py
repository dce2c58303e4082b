"""Kiln's backends beside llama.cpp on one model, in one run: prefill, decode, 16-stream throughput.

    make bench-compare
    .venv/bin/python bench/compare.py [--model NAME] [--repeats 3] [--stream-repeats 1]
        [--skip ROW ...] [--artifacts-dir DIR] [--threads N] [--row-budget 120] [--compile-only]

Rows: kiln artifacts (`reference`, `tvm`, `tvm-gguf`, `ort`, `ort-int4`), each compiled once into
--artifacts-dir (reused while the model, the options and the compiler code are the same) and measured
by the same code; `llama.cpp` on the same GGUF, measured in a subprocess of .venv-peers
(`make bench-peers` builds it) through llama-cpp-python's low-level batch API.

Columns: prefill tokens/s of a --prompt-len prompt in one step (single sequence); greedy decode
tokens/s of --decode-len steps of one token after it; output tokens/s of --streams concurrent
requests (--stream-input-len in, --stream-output-len out, EOS ignored) through the AsyncEngine
(llama.cpp: one context with --streams sequences, batched llama_decode); each against llama.cpp
(the reference row where llama.cpp is missing); then the memory-bandwidth floor: the weights' bytes
(read once per decode step) over the measured read bandwidth, the decode tokens/s no kernel can beat
(unless the weights sit in the CPU's cache); for a mixture-of-experts model the bytes count top_k of
the E experts' weights (what a decode token reads) and a note gives the dense-equivalent bytes (every
expert). Prefill and decode are medians of --repeats, throughput of
--stream-repeats; a row stops repeating once a kind of run has taken --row-budget seconds (noted).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the llama.cpp worker runs in .venv-peers and imports neither torch nor kiln
    from kiln.backends.base import Executable
    from kiln.runtime.artifact import LoadedArtifact

BLOCK_SIZE = 16
LLAMA_CPP = "llama.cpp"
REPO = Path(__file__).resolve().parent.parent
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
T = TypeVar("T")


@dataclass(frozen=True)
class KilnRow:
    label: str
    backend: str
    quantization: str | None


KILN_ROWS = {
    "reference": KilnRow("kiln reference f32 (O2)", "reference", None),
    "tvm": KilnRow("kiln TVM-CPU f32", "tvm", None),
    "tvm-gguf": KilnRow("kiln TVM-CPU gguf (the GGUF's own blocks)", "tvm", "gguf"),
    "ort": KilnRow("kiln ORT-CPU f32", "onnxruntime", None),
    "ort-int4": KilnRow("kiln ORT-CPU int4", "onnxruntime", "int4"),
}
ROW_NAMES = (*KILN_ROWS, LLAMA_CPP)


@dataclass
class Result:
    key: str
    label: str
    prefill: float | None = None
    decode: float | None = None
    streams: float | None = None
    weight_bytes: int | None = None
    dense_bytes: int | None = None  # a mixture of experts: every expert's weights read, as a dense model
    error: str | None = None  # the whole row is n/a
    notes: list[str] = field(default_factory=list)


def _runs(measure: Callable[[], T], times: int, budget: float) -> list[T]:
    """`times` results of `measure`, fewer when they pass `budget` seconds (at least one)."""
    results, start = [], time.perf_counter()
    for _ in range(times):
        results.append(measure())
        if time.perf_counter() - start > budget:
            break
    return results


def _short(what: str, done: int, wanted: int, budget: float) -> list[str]:
    return [f"{what}: {done} of {wanted} runs (past --row-budget {budget:g} s)"] if done < wanted else []


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text[:160]}"


# -- compiling kiln artifacts once -----------------------------------------------------------------


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _backend_packages(root: Path, backend: str) -> list[str]:
    """The backend's package and those it imports (e.g. onnxruntime → onnx), transitively."""
    found, pending = {backend}, [backend]
    while pending:
        for file in _files_under(root / "backends" / pending.pop()):
            if file.suffix != ".py":
                continue
            for name in re.findall(r"kiln\.backends\.(\w+)", file.read_text()):
                if (root / "backends" / name).is_dir() and name not in found:
                    found.add(name)
                    pending.append(name)
    return sorted(found)


def _code_digest(backend: str) -> str:
    """The sha256 of the code that compiles for `backend` (kiln.llm.compiler_digest covers every backend:
    an edit to one would recompile all rows)."""
    import kiln

    root = Path(kiln.__file__).resolve().parent
    parts = [root / p for p in ("frontend", "ir", "passes", "compiler", "tuning_logs")]
    parts += sorted((root / "backends").glob("*.py"))
    parts += [root / "backends" / name for name in _backend_packages(root, backend)]
    digest = hashlib.sha256()
    for part in parts:
        for file in _files_under(part):
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _artifact(key: str, row: KilnRow, model: str, source: str, folder: Path, threads: int) -> Path:
    """The artifact folder for a row: reused when its key matches; if not, compiled by `kiln compile` in a
    child process (the compiler's thread pools and memory stay out of the measuring one), and the row's
    stale folders removed."""
    from kiln import __version__
    from kiln.backends.registry import get_backend
    from kiln.runtime.artifact import is_artifact

    quantization = row.quantization or "none"
    key_parts = {
        "model": model,
        "source": source,
        "options": {"backend": row.backend, "quantization": quantization, "opt_level": 2, "max_num_seqs": 16},
        "threads": threads,
        "kiln": __version__,
        "code": _code_digest(row.backend),
        "backend": get_backend(row.backend).version(),
    }
    digest = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:12]
    out = folder / f"{key}-{digest}"
    if is_artifact(out):
        _say(f"[{key}] reusing {out}")
        return out
    command = [
        *(sys.executable, "-m", "kiln.cli", "compile", model, "--backend", row.backend),
        *("--quantization", quantization, "--opt-level", "2", "--max-num-seqs", "16"),
        *("--num-threads", str(threads), "-o", str(out), "--quiet"),
    ]
    _say(f"[{key}] kiln {' '.join(command[4:])}")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "kiln: error" in line]
        tail = lines or done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        raise RuntimeError(f"kiln compile failed: {tail[-1][:200]}")
    _say(f"[{key}] compiled in {time.perf_counter() - start:.0f} s")
    stale = re.compile(re.escape(key) + r"-[0-9a-f]{12}(\.partial)?")
    for other in folder.iterdir():
        if other != out and other.is_dir() and stale.fullmatch(other.name):
            shutil.rmtree(other, ignore_errors=True)
    return out


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def _decode_bytes(
    sizes: dict[str, tuple[int, int]], gather_only: set[str], experts: Callable[[str], bool], share: float
) -> int:
    """Weight bytes one decode step reads: every tensor once, but one row of each table that is only
    gathered (name → (bytes, rows)), and `share` (top_k / E) of the tensors of stacked experts."""
    total = 0.0
    for name, (size, rows) in sizes.items():
        total += size // rows if name in gather_only else size * (share if experts(name) else 1.0)
    return int(total)


def _expert_share(config: dict[str, Any]) -> float:
    experts = int(config.get("num_experts") or 0)
    return int(config.get("num_experts_per_tok") or 0) / experts if experts else 1.0


def _artifact_decode_bytes(
    path: Path, config: dict[str, Any], held: dict[str, int] | None = None
) -> tuple[int, int]:
    """From the artifact's weights file, or `held`: each weight's bytes as the compiled code holds it
    (backends.base.held_weight_bytes; a weight it does not hold is not read). A table only gathered
    from is counted one row: a float X beside a quantized X.qweight, and the token embedding where
    the LM head has weights of its own (untied, or the gguf import's quantized copy of a tied table)."""
    sizes = {
        name: (
            meta["data_offsets"][1] - meta["data_offsets"][0] if held is None else held[name],
            max(1, (meta["shape"] or [1])[0]),
        )
        for name, meta in _header(path).items()
        if held is None or name in held
    }
    own_head = any(name.startswith("lm_head.weight") for name in sizes)
    embedding = {"model.embed_tokens.weight"} if own_head else set()
    gathered = {name for name in sizes if f"{name}.qweight" in sizes} | embedding

    def experts(name: str) -> bool:
        return ".mlp.experts." in name

    return (
        _decode_bytes(sizes, gathered, experts, _expert_share(config)),
        _decode_bytes(sizes, gathered, experts, 1.0),
    )


# -- measuring a kiln artifact ---------------------------------------------------------------------


def _prefill_decode(executable: Executable, prompt: list[int], decode_len: int) -> tuple[float, float]:
    """(prompt tokens/s of one step over the whole prompt, tokens/s of `decode_len` greedy steps)."""
    from kiln.backends.base import allocate_kv_cache
    from kiln.ir.step import SequenceSlice, build_step_inputs

    num_blocks = -(-(len(prompt) + decode_len) // BLOCK_SIZE)
    cache = allocate_kv_cache(executable, num_blocks, BLOCK_SIZE)
    table = list(range(num_blocks))
    start = time.perf_counter()
    logits = executable.step(build_step_inputs([SequenceSlice(prompt, 0, table)], BLOCK_SIZE), cache)
    prefill_s = time.perf_counter() - start
    token, cached = int(logits[0].argmax()), len(prompt)
    start = time.perf_counter()
    for _ in range(decode_len):
        inputs = build_step_inputs([SequenceSlice([token], cached, table)], BLOCK_SIZE)
        token = int(executable.step(inputs, cache)[0].argmax())
        cached += 1
    return len(prompt) / prefill_s, decode_len / (time.perf_counter() - start)


async def _streams_round(engine: Any, prompts: list[list[int]], output_len: int) -> float:
    from kiln.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        count = 0
        async for output in engine.generate(prompt, params):
            count += len(output.outputs[0].delta_token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


def _streams(
    artifact: LoadedArtifact, rounds: list[list[list[int]]], output_len: int, budget: float
) -> list[float]:
    """Output tokens/s of each round's prompts, all submitted at once to one AsyncEngine."""
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.scheduler import SchedulerConfig

    streams = len(rounds[0])
    per_seq = -(-(len(rounds[0][0]) + output_len) // BLOCK_SIZE) + 1
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=streams * per_seq + 8,
        enable_prefix_caching=False,
        scheduler=SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=512),
    )
    llm_engine = LLMEngine(
        artifact.executable, artifact.tokenizer, artifact.model_id, artifact.max_model_len, config
    )
    engine = AsyncEngine(llm_engine)
    try:
        asyncio.run(_streams_round(engine, [p[:8] for p in rounds[0]], 2))  # warm up batch shapes
        pending = iter(rounds)
        return _runs(
            lambda: asyncio.run(_streams_round(engine, next(pending), output_len)), len(rounds), budget
        )
    finally:
        engine.shutdown()


def _measure_kiln(
    result: Result, folder: Path, prompt: list[int], args: argparse.Namespace, rounds: list[list[list[int]]]
) -> None:
    from kiln.runtime.artifact import load_artifact, read_manifest

    artifact = load_artifact(folder)
    config = read_manifest(folder)["model"]["config"]
    weights = folder / artifact.target_entry["weights"]
    executable = artifact.executable
    held = executable.held_weight_bytes
    result.weight_bytes, result.dense_bytes = _artifact_decode_bytes(weights, config, held)
    _prefill_decode(executable, prompt[:64], 4)  # warm up (first-call allocations, thread pools)
    runs = _runs(lambda: _prefill_decode(executable, prompt, args.decode_len), args.repeats, args.row_budget)
    result.notes += _short("prefill/decode", len(runs), args.repeats, args.row_budget)
    result.prefill = statistics.median(p for p, _ in runs)
    result.decode = statistics.median(d for _, d in runs)
    _say(f"[{result.key}] prefill {result.prefill:.1f} tok/s, decode {result.decode:.1f} tok/s")
    try:
        streams = _streams(artifact, rounds, args.stream_output_len, args.row_budget)
        result.notes += _short(f"{args.streams}-stream", len(streams), len(rounds), args.row_budget)
        result.streams = statistics.median(streams)
        _say(f"[{result.key}] {args.streams} streams {result.streams:.1f} tok/s")
    except Exception as error:
        result.notes.append(f"{args.streams}-stream n/a ({_reason(error)})")


# -- llama.cpp, in .venv-peers ---------------------------------------------------------------------


def _llama_worker() -> None:
    """Reads a JSON spec on stdin, prints one JSON line of results (run by .venv-peers/bin/python)."""
    import llama_cpp as lc
    import numpy as np

    spec = json.load(sys.stdin)
    threads, n_batch = int(spec["threads"]), int(spec["batch"])
    prompt, decode_len = spec["prompt"], int(spec["decode_len"])
    rounds, output_len = spec["stream_rounds"], int(spec["stream_output_len"])
    streams = len(rounds[0])
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(spec["path"].encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {spec['path']}")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(max(n_batch, streams), 0, 1)

    def new_context(n_ctx: int, n_seq: int) -> Any:
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = threads
        ctx = lc.llama_init_from_model(model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp cannot make a context of {n_ctx} tokens, {n_seq} sequences")
        return ctx

    def decode(ctx: Any, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(items)
        code = lc.llama_decode(ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def argmax(ctx: Any, index: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).argmax())

    def prefill_decode(ctx: Any, tokens: list[int], steps: int) -> tuple[float, float]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        for offset in range(0, len(tokens), n_batch):
            chunk = tokens[offset : offset + n_batch]
            decode(ctx, [(t, offset + i, 0, offset + i == len(tokens) - 1) for i, t in enumerate(chunk)])
        lc.llama_synchronize(ctx)
        prefill_s = time.perf_counter() - start
        token = argmax(ctx, -1)
        start = time.perf_counter()
        for step in range(steps):
            decode(ctx, [(token, len(tokens) + step, 0, True)])
            token = argmax(ctx, 0)
        return len(tokens) / prefill_s, steps / (time.perf_counter() - start)

    def streams_round(ctx: Any, prompts: list[list[int]]) -> float:
        """Prompts in batches of n_batch tokens (a sequence's last token gives its first output), then
        one batched step of all sequences per output token."""
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        flat = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        nexts, positions = [0] * len(prompts), [len(p) for p in prompts]
        start = time.perf_counter()
        for offset in range(0, len(flat), n_batch):
            chunk = flat[offset : offset + n_batch]
            decode(ctx, chunk)
            for index, (_, _, seq, last) in enumerate(chunk):
                if last:
                    nexts[seq] = argmax(ctx, index)
        produced = len(prompts)
        for _ in range(output_len - 1):
            decode(ctx, [(nexts[s], positions[s], s, True) for s in range(len(prompts))])
            for s in range(len(prompts)):
                nexts[s], positions[s] = argmax(ctx, s), positions[s] + 1
            produced += len(prompts)
        return produced / (time.perf_counter() - start)

    out: dict[str, Any] = {"version": lc.__version__, "threads": threads}
    single = new_context(-(-(len(prompt) + decode_len + 64) // 256) * 256, 1)
    prefill_decode(single, prompt[:64], 4)  # warm up
    budget = float(spec["budget"])
    runs = _runs(lambda: prefill_decode(single, prompt, decode_len), int(spec["repeats"]), budget)
    out["runs"] = len(runs)
    out["prefill"] = statistics.median(p for p, _ in runs)
    out["decode"] = statistics.median(d for _, d in runs)
    lc.llama_free(single)
    per_seq = -(-(len(rounds[0][0]) + output_len + 64) // 256) * 256
    try:
        multi = new_context(streams * per_seq, streams)  # kv_unified off: n_ctx / n_seq_max each
        streams_round(multi, [p[:8] for p in rounds[0]])  # warm up
        pending = iter(rounds)
        done = _runs(lambda: streams_round(multi, next(pending)), len(rounds), budget)
        out["streams"], out["stream_runs"] = statistics.median(done), len(done)
        lc.llama_free(multi)
    except RuntimeError as error:
        out["streams_error"] = str(error)
    lc.llama_batch_free(batch)
    lc.llama_model_free(model)
    print(json.dumps(out), flush=True)


def _gguf_decode_bytes(path: Path) -> tuple[int, int] | None:
    """(decode bytes, dense-equivalent bytes). token_embd is the LM head too unless the file has an
    output.weight (then only a row is read); `*_exps` tensors hold the experts."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def number(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[-1][0]) if field is not None else 0

    share = number("expert_used_count") / number("expert_count") if number("expert_count") else 1.0
    sizes = {t.name: (int(t.n_bytes), max(1, int(t.shape[-1]))) for t in reader.tensors}  # ne, fastest first
    gathered = {"token_embd.weight"} if "output.weight" in sizes else set()

    def experts(name: str) -> bool:
        return "_exps." in name

    return _decode_bytes(sizes, gathered, experts, share), _decode_bytes(sizes, gathered, experts, 1.0)


def _measure_llama_cpp(
    result: Result, gguf: Path, prompt: list[int], args: argparse.Namespace, rounds: list[list[list[int]]]
) -> None:
    if not PEERS_PYTHON.exists():
        result.error = "not installed: run make bench-peers"
        return
    spec = {
        "path": str(gguf),
        "threads": args.threads,
        "batch": 512,
        "prompt": prompt,
        "decode_len": args.decode_len,
        "repeats": args.repeats,
        "budget": args.row_budget,
        "stream_rounds": rounds,
        "stream_output_len": args.stream_output_len,
    }
    _say(f"[{LLAMA_CPP}] {PEERS_PYTHON} on {gguf}")
    done = subprocess.run(
        [str(PEERS_PYTHON), str(Path(__file__).resolve()), "--llama-worker"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        result.error = f"worker exited {done.returncode}: {tail[:160]}"
        return
    out = json.loads(lines[-1])
    result.label = f"llama.cpp {out['version']} (same GGUF)"
    result.prefill, result.decode = out["prefill"], out["decode"]
    result.streams = out.get("streams")
    result.notes += _short("prefill/decode", out["runs"], args.repeats, args.row_budget)
    result.notes += _short(
        f"{args.streams}-stream", out.get("stream_runs", len(rounds)), len(rounds), args.row_budget
    )
    if "streams_error" in out:
        result.notes.append(f"{args.streams}-stream n/a ({out['streams_error'][:160]})")
    result.weight_bytes, result.dense_bytes = _gguf_decode_bytes(gguf) or (None, None)
    _say(f"[{LLAMA_CPP}] prefill {result.prefill:.1f}, decode {result.decode:.1f}, streams {result.streams}")


# -- the table -------------------------------------------------------------------------------------


def _read_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of torch summing a `mib` MiB float32 tensor on `threads` threads (a decode step reads its
    weights on every thread the engines use; loading a CPU artifact sets torch to one), median."""
    import torch

    source = torch.ones(mib * (1 << 20) // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source.sum()  # fault the pages in
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            source.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return source.numel() * 4 / statistics.median(times)


def _l3_bytes() -> int | None:
    """The last-level cache of CPU 0 (sysfs), or None."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    return None


def _cell(value: float | None, width: int, digits: int = 1) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def _print_table(results: list[Result], base: Result | None, bandwidth: float, streams: int) -> None:
    versus = f"vs {base.key}" if base is not None else "vs -"
    head = (
        f"{'engine':<38}{'prefill':>9}{'decode':>8}{f'{streams}-str':>8}  {versus + ' (p/d/s)':<24}"
        f"{'weights':>8}{'ceiling':>9}{'of ceil':>8}"
    )
    print(head)
    print(f"{'':<38}{'tok/s':>9}{'tok/s':>8}{'tok/s':>8}  {'':<24}{'MiB':>8}{'tok/s':>9}{'':>8}")
    for row in results:
        if row.error is not None:
            print(f"{row.label:<38}n/a ({row.error})")
            continue
        ratios = " / ".join(
            _ratio(getattr(row, name), getattr(base, name) if base else None)
            for name in ("prefill", "decode", "streams")
        )
        ceiling = bandwidth / row.weight_bytes if row.weight_bytes else None
        share = f"{100 * row.decode / ceiling:>7.0f}%" if ceiling and row.decode else f"{'-':>8}"
        mib = row.weight_bytes / (1 << 20) if row.weight_bytes else None
        print(
            f"{row.label:<38}{_cell(row.prefill, 9)}{_cell(row.decode, 8)}{_cell(row.streams, 8)}  "
            f"{ratios:<24}{_cell(mib, 8)}{_cell(ceiling, 9)}{share}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3, help="prefill and decode runs (median)")
    parser.add_argument("--stream-repeats", type=int, default=1, help="throughput runs (median)")
    parser.add_argument(
        "--row-budget",
        type=float,
        default=120.0,
        help="seconds after which a row's repeats stop (of each kind)",
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=ROW_NAMES, metavar="ROW", help=str(ROW_NAMES)
    )
    parser.add_argument("--artifacts-dir", type=Path, default=None, help="default $KILN_HOME/bench-compare")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="for every engine")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-input-len", type=int, default=128)
    parser.add_argument("--stream-output-len", type=int, default=128)
    parser.add_argument("--compile-only", action="store_true", help="compile the artifacts, measure nothing")
    parser.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_worker:
        _llama_worker()
        return

    began, load_start = time.perf_counter(), os.getloadavg()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))  # before any TVM runtime starts
    import torch

    from kiln.compiler.source_digest import source_digest
    from kiln.frontend.pull import kiln_home, resolve_model

    torch.set_num_threads(args.threads)
    gguf = resolve_model(args.model)
    folder = args.artifacts_dir or kiln_home() / "bench-compare" / args.model
    folder.mkdir(parents=True, exist_ok=True)
    source = source_digest(gguf)
    wanted = [name for name in ROW_NAMES if name not in args.skip]

    folders: dict[str, Path | str] = {}  # the artifact, or why there is none
    for key in (k for k in wanted if k in KILN_ROWS):
        try:
            folders[key] = _artifact(key, KILN_ROWS[key], args.model, source, folder, args.threads)
        except Exception as error:
            folders[key] = _reason(error)
            _say(f"[{key}] compile failed: {folders[key]}")
    if args.compile_only:
        return

    generator = torch.Generator().manual_seed(0)
    vocab = 49152  # SmolLM2; token ids in [100, vocab) are ordinary tokens
    try:
        from kiln.runtime.artifact import read_manifest

        some = next(p for p in folders.values() if isinstance(p, Path))
        vocab = int(read_manifest(some)["model"]["config"]["vocab_size"])
    except (StopIteration, KeyError):
        pass

    def draw(length: int) -> list[int]:
        return torch.randint(100, vocab, (length,), generator=generator).tolist()

    prompt = draw(args.prompt_len)
    rounds = [[draw(args.stream_input_len) for _ in range(args.streams)] for _ in range(args.stream_repeats)]
    bandwidth_start = _read_bandwidth(args.threads)
    _say(f"read bandwidth {bandwidth_start / 1e9:.1f} GB/s")

    results: list[Result] = []
    for key in wanted:
        result = Result(key, KILN_ROWS[key].label if key in KILN_ROWS else LLAMA_CPP)
        results.append(result)
        where = folders.get(key)
        if key in KILN_ROWS and not isinstance(where, Path):
            result.error = f"compile: {where}"
            continue
        row_start = time.perf_counter()
        try:
            if isinstance(where, Path):
                _measure_kiln(result, where, prompt, args, rounds)
            else:
                _measure_llama_cpp(result, gguf, prompt, args, rounds)
        except Exception as error:
            result.error = _reason(error)
            _say(f"[{key}] failed: {result.error}")
        gc.collect()
        _say(f"[{key}] {time.perf_counter() - row_start:.0f} s")

    by_key = {r.key: r for r in results if r.error is None}
    base = by_key.get(LLAMA_CPP) or by_key.get("reference")
    bandwidth_end = _read_bandwidth(args.threads)
    bandwidth = max(bandwidth_start, bandwidth_end)  # the ceiling is what the machine can do when least busy
    load_end = os.getloadavg()
    print()
    print(
        f"{args.model}: {gguf.name}; prefill {args.prompt_len} tokens (one step), decode {args.decode_len} "
        f"(greedy), {args.streams} streams of {args.stream_input_len} in / {args.stream_output_len} out"
    )
    print(
        f"medians of {args.repeats} (prefill, decode) and {args.stream_repeats} ({args.streams}-stream); "
        f"threads {args.threads} (torch {torch.get_num_threads()}, TVM_NUM_THREADS "
        f"{os.environ['TVM_NUM_THREADS']}, ORT intra-op {args.threads}, llama.cpp {args.threads}); "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"load average {load_start[0]:.2f} / {load_start[1]:.2f} at start, {load_end[0]:.2f} / "
        f"{load_end[1]:.2f} at end (1 / 5 min); read bandwidth ({args.threads} threads) "
        f"{bandwidth_start / 1e9:.1f} GB/s at start, {bandwidth_end / 1e9:.1f} at end"
    )
    print()
    _print_table(results, base, bandwidth, args.streams)
    print()
    notes = [
        "ratios: prefill / decode / streams against the row named in the header",
        "ceiling: read bandwidth (the higher of start and end) / weight bytes, the decode tok/s if each step "
        "read every weight once at that speed and did nothing else (KV cache reads not counted); a TVM "
        "row's weights as its kernels hold them (packed planes, factored K-quant scales)",
        f"llama.cpp {args.streams}-stream: one context with {args.streams} sequences, prompts in 512-token "
        f"llama_decode batches, then one batched llama_decode per output token (not llama-server)",
        f"kiln {args.streams}-stream: AsyncEngine, max_num_seqs {args.streams}, max_num_batched_tokens 512",
    ]
    cache = _l3_bytes()
    small = [
        r.key for r in results if r.error is None and cache and r.weight_bytes and r.weight_bytes < cache
    ]
    if small:
        notes.append(
            f"last-level cache {cache / (1 << 20):.0f} MiB: the weights of {', '.join(small)} fit in it, so "
            "their steps may read weights from cache, not DRAM, and beat the ceiling"
        )
    notes += [
        f"{r.key}: decode reads {r.weight_bytes / (1 << 20):.1f} MiB of weights a token (the chosen experts "
        f"only); dense-equivalent (every expert) {r.dense_bytes / (1 << 20):.1f} MiB"
        for r in results
        if r.weight_bytes and r.dense_bytes and r.dense_bytes != r.weight_bytes
    ]
    notes += [f"{r.key}: {note}" for r in results for note in r.notes]
    for note in notes:
        print(f"* {note}")
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
