"""KV offload on a real model: the time to first token of a long system prompt plus a short question
after a server restart, with the disk tier (`--kv-offload-dir`) and without it, beside llama-server's
slot save / restore of the same prompt; and the decode step's time while the tier writes, under 16 streams.

    .venv/bin/python bench/kv_offload.py [--model smollm2-135m-instruct] [--system-tokens 4000] [--repeats 3]

Restart: every repeat starts a fresh server process and asks one question (a new one each repeat) after
the same system prompt; TTFT is measured by the client from the request to the first streamed token.
The disk tier's folder is filled once beforehand by another server. "page cache dropped": the folder's
files are evicted from the page cache (posix_fadvise DONTNEED) before the start, so the blocks come from
the disk. llama-server: `--slot-save-path`, the slot saved once after the system prompt; each repeat
restores it (POST /slots/0?action=restore) and asks; its TTFT counts the restore.

Step time: the engine in this process on the same artifact; a first batch of 16 streams leaves its
blocks cached, then 16 streams of other prompts decode 256 tokens, their new blocks evicting the first
batch's (each written back to the tier as it goes, besides the prompts' blocks written through); the
steps where all 16 decode, offload off and on alternating, medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_peers import KILN, LLAMA_SERVER, free_port, prepare, start, stop  # bench/serve_peers.py

from kiln.runtime.artifact import TOKENIZER_FILE, read_manifest
from kiln.runtime.tokenizer import Tokenizer


def system_prompt(tokens: int, count_tokens: Any) -> str:
    """Tool-preamble-like rules, as many as make about `tokens` tokens."""
    rules: list[str] = []
    while True:
        index = len(rules)
        rules.append(
            f"Tool {index}: call `tool_{index}(path, mode={index % 7})` to read a file of section {index}; "
            f"it returns JSON with keys name, size and lines. Never call it twice for one path."
        )
        if len(rules) % 8 == 0 and count_tokens("\n".join(rules)) >= tokens:
            return "\n".join(rules)


def rss_peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def ttft(port: int, system: str, question: str, model: str = "bench") -> tuple[float, str]:
    """Seconds to the first streamed token, and the answer's text (greedy, 8 tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    began = time.perf_counter()
    first = None
    text = ""
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - began
            text += delta
    return (first if first is not None else time.perf_counter() - began), text


def evict_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            descriptor = os.open(path, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


QUESTIONS = [
    "Which tool reads section 3?",
    "What keys does tool 5 return?",
    "May I call tool 2 twice for one path?",
    "Which mode does tool 9 use?",
    "What does tool 11 read?",
    "Name the tool for section 20.",
    "What is the mode of tool 13?",
]


def kiln_restarts(args: argparse.Namespace, artifact: Path, work: Path, system: str) -> dict[str, Any]:
    """TTFT after a restart: no tier; the disk tier (page cache warm, and dropped)."""
    folder = work / "kv-offload"
    shutil.rmtree(folder, ignore_errors=True)
    common = ["--served-model-name", "bench", "--uvicorn-log-level", "warning", "--max-model-len", "8192"]
    offload = ["--kv-offload-dir", str(folder)]

    def one(flags: list[str], question: str, evict: bool = False) -> tuple[float, float, str]:
        if evict:
            evict_page_cache(folder)
        port = free_port()
        process, _ = start(
            [*KILN, "serve", str(artifact), "--port", str(port), *common, *flags], port, work / "kiln.log"
        )
        try:
            seconds, text = ttft(port, system, question)
            return seconds, rss_peak_mib(process.pid), text
        finally:
            stop(process)

    one(offload, "Hello?")  # fills the folder (stopped gracefully: every block written)
    stored = sum(path.stat().st_size for path in folder.rglob("*.kvb"))
    rows: dict[str, list[tuple[float, float, str]]] = {
        "no tier": [],
        "disk tier": [],
        "disk tier, page cache dropped": [],
    }
    for repeat in range(args.repeats):
        question = QUESTIONS[repeat % len(QUESTIONS)]
        rows["no tier"].append(one([], question))
        rows["disk tier"].append(one(offload, question))
        rows["disk tier, page cache dropped"].append(one(offload, question, evict=True))
        for name in rows:
            print(f"  repeat {repeat}: {name}: TTFT {rows[name][-1][0]:.3f} s", flush=True)
    return {"rows": rows, "stored_bytes": stored}


def llama_restarts(args: argparse.Namespace, gguf: Path, work: Path, system: str) -> dict[str, Any]:
    """llama-server: TTFT cold, and after restoring the slot saved after the system prompt."""
    slots = work / "llama-slots"
    shutil.rmtree(slots, ignore_errors=True)
    slots.mkdir(parents=True)

    def launch() -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        command = [str(LLAMA_SERVER), "-m", str(gguf), "-np", "1", "-t", str(args.threads), "-c", "8192"]
        command += ["--port", str(port), "--alias", "bench", "--slot-save-path", str(slots)]
        process, _ = start(command, port, work / "llama.log")
        return process, port

    process, port = launch()
    ttft(port, system, "Hello?")
    saved = httpx.post(
        f"http://127.0.0.1:{port}/slots/0?action=save", json={"filename": "system.bin"}, timeout=600
    )
    saved.raise_for_status()
    stop(process)
    rows: dict[str, list[tuple[float, float, str]]] = {"cold": [], "slot restored": []}
    for repeat in range(args.repeats):
        question = QUESTIONS[repeat % len(QUESTIONS)]
        process, port = launch()
        seconds, text = ttft(port, system, question)
        rows["cold"].append((seconds, rss_peak_mib(process.pid), text))
        stop(process)
        process, port = launch()
        began = time.perf_counter()
        restored = httpx.post(
            f"http://127.0.0.1:{port}/slots/0?action=restore", json={"filename": "system.bin"}, timeout=600
        )
        restored.raise_for_status()
        restore_s = time.perf_counter() - began
        seconds, text = ttft(port, system, question)
        rows["slot restored"].append((restore_s + seconds, rss_peak_mib(process.pid), text))
        stop(process)
        print(
            f"  repeat {repeat}: llama-server cold {rows['cold'][-1][0]:.3f} s, "
            f"restored {restore_s + seconds:.3f} s"
        )
    return {"rows": rows, "stored_bytes": (slots / "system.bin").stat().st_size}


def decode_steps(engine: Any, tag: str, max_tokens: int) -> list[float]:
    """16 streams of distinct prompts to the end; the seconds of each step where all 16 decode."""
    import kiln

    params = kiln.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for stream in range(16):
        words = " ".join(f"item {stream * 1000 + i}" for i in range(60))
        engine.add_request(f"{tag}-{stream}", f"Stream {stream} of {tag}: {words}", params)
    durations = []
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        prefilling = any(seq.num_tokens - seq.num_computed_tokens > 1 for seq in scheduler.running)
        all_in = len(scheduler.running) == 16 and not scheduler.waiting
        began = time.perf_counter()
        engine.step()
        if all_in and not prefilling:
            durations.append(time.perf_counter() - began)
    return durations


def step_times(args: argparse.Namespace, artifact: Path, work: Path) -> dict[str, Any]:
    """Median decode step (ms) with 16 streams, offload off / on, alternating rounds. A first batch of
    16 leaves its blocks cached in the pool; the measured batch's new blocks evict them, so with the
    tier on every eviction is written back while the 16 decode (and their prompts written through)."""
    import kiln

    folder = work / "kv-offload-steps"
    results: dict[str, list[float]] = {"off": [], "on": []}
    written: list[int] = []
    for round_index in range(args.rounds):
        for mode in ("off", "on"):
            shutil.rmtree(folder, ignore_errors=True)
            options: dict[str, Any] = {"kv_offload_dir": folder} if mode == "on" else {}
            # no step-time limit on prompts: the 16 are in within a few steps, then all decode together
            llm = kiln.LLM(str(artifact), max_model_len=4096, max_step_ms=1e6, show_progress=False, **options)
            decode_steps(llm.engine, f"warm-{round_index}", 128)
            before = llm.engine.offload_stats()
            durations = decode_steps(llm.engine, f"measured-{round_index}", 256)
            stats = llm.engine.offload_stats()
            if stats is not None and before is not None:
                written.append(stats.tiers["disk"].written_bytes - before.tiers["disk"].written_bytes)
            median = statistics.median(durations) * 1000
            results[mode].append(median)
            llm.close()
            print(
                f"  round {round_index}: offload {mode}: median decode step {median:.2f} ms "
                f"over {len(durations)} steps",
                flush=True,
            )
    return {"ms": results, "written_bytes": written}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds of the step bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["kiln", "llama", "steps"])
    parser.add_argument("--work", default=None, help="where artifacts and folders go (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    work = Path(args.work or tempfile.mkdtemp(prefix="kiln-kv-offload-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf, artifact = prepare(args, work)

    fields = dict(read_manifest(artifact)["tokenizer"])
    fields["tokenizer_json"] = (artifact / TOKENIZER_FILE).read_text()
    fields["chat_template"] = None
    tokenizer = Tokenizer.from_dict(fields)  # the artifact's own, to count the prompt's tokens
    system = system_prompt(args.system_tokens, lambda text: len(tokenizer.encode(text)))
    print(
        f"system prompt: {len(tokenizer.encode(system))} tokens; load average {os.getloadavg()}", flush=True
    )
    report: dict[str, Any] = {"model": args.model, "system_tokens": len(tokenizer.encode(system))}
    if "kiln" not in args.skip:
        report["kiln"] = kiln_restarts(args, artifact, work, system)
    if "llama" not in args.skip and LLAMA_SERVER.is_file():
        report["llama"] = llama_restarts(args, gguf, work, system)
    if "steps" not in args.skip:
        report["steps"] = step_times(args, artifact, work)
    report["load_average_after"] = os.getloadavg()
    report["bench_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_table(report)
    (work / "kv_offload.json").write_text(json.dumps(report, indent=1))
    print(f"raw figures: {work / 'kv_offload.json'}")


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['model']}, system prompt {report['system_tokens']} tokens + a question (medians)\n")
    print("| server | TTFT after restart (s) | vs no tier | answers as without a tier | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for who in ("kiln", "llama"):
        if who not in report:
            continue
        table = report[who]["rows"]
        cold = next(iter(table.values()))
        base = statistics.median(r[0] for r in cold)
        for name, rows in table.items():
            seconds = statistics.median(r[0] for r in rows)
            same = sum(r[2] == c[2] for r, c in zip(rows, cold, strict=True))
            rss = max(r[1] for r in rows)
            label = f"{'kiln' if who == 'kiln' else 'llama-server'}: {name}"
            print(f"| {label} | {seconds:.3f} | {base / seconds:.1f}x | {same} of {len(rows)} | {rss:,.0f} |")
        print(f"| ({who} stored {report[who]['stored_bytes'] / 2**20:,.1f} MiB) | | | | |")
    if "steps" in report:
        off = statistics.median(report["steps"]["ms"]["off"])
        on = statistics.median(report["steps"]["ms"]["on"])
        written = max(report["steps"]["written_bytes"], default=0) / 2**20
        print(
            f"\ndecode step, 16 streams: offload off {off:.2f} ms, on {on:.2f} ms ({on / off - 1:+.1%}); "
            f"{written:,.0f} MiB written while the measured batch ran"
        )
    print(
        f"bench process peak RSS {report['bench_peak_rss_mib']:,.0f} MiB; "
        f"load average after {report['load_average_after']}"
    )


if __name__ == "__main__":
    main()
