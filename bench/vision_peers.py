"""One image, Kiln against llama.cpp's mtmd on the same GGUF and mmproj: `kiln serve TEXT.gguf --mmproj
MMPROJ.gguf` and `llama-server -m TEXT.gguf --mmproj MMPROJ.gguf`, one after the other, 2 threads each.

    .venv/bin/python bench/vision_peers.py [--family smolvlm|gemma3] [--shape 256m|tiny] [--runs 5]
        [--seeds S ...] [--threads 2] [--record tests/fixtures/smolvlm_tiny_llama_cpp.json]

The model has random weights (scripts/make_vlm.py): SmolVLM-shaped ("256m" has SmolVLM-256M's shapes,
SigLIP-base at 512 x 512 and a 30-layer Llama of width 576) or a tiny Gemma 3, converted by llama.cpp's
own converter; made once under $KILN_HOME/bench-vision/<shape> (<family>-<shape> for Gemma 3). Each run
sends a new image (so neither server's prompt cache helps) with a short text as a chat completion,
greedy, 16 tokens. An image is one colour drawn from its seed (scripts/make_vlm.py `image`; seeds 0 ..
runs - 1, or --seeds): resizing keeps it, so both servers see the same pixels.

Per server: time to first token (client side, median; a one-token request), the image's encode time
(Kiln: the artifact's `encode_image` over the image's tiles in this process after the servers stop;
llama.cpp: from its
log, the time from "encoding mtmd batch" to the image batch's decode), cold start, peak RSS. The two
servers' greedy tokens are compared (llama-server's logprobs give its token ids); any difference is an
error, and so is (with `--record`) an image whose tokens another image's equal. `--record` writes
llama-server's tokens for each image (the fixture tests/frontend/test_vision_gguf.py checks Kiln
against, and checks that the images' tokens differ); the recorded seeds are ones whose tokens differ
at the first token with a clear margin on the tiny models (chosen by trying 24 seeds).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import make_vlm  # scripts/make_vlm.py
from serve_peers import KILN, LLAMA_SERVER, free_port, start, stop  # bench/serve_peers.py

PROMPT = "abc"
SERVED = ["--served-model-name", "bench"]
MAX_TOKENS = 16
IMAGE_SIZES = {"tiny": (50, 40), "256m": (512, 384)}  # width, height
# llama.cpp resizes without Pillow's antialiasing (which transformers' processors use, and Kiln with
# them): a downscaled image's pixel values differ. Gemma 3's tiny images are sent at its 32 x 32.
FAMILY_IMAGE_SIZES = {("gemma3", "tiny"): (32, 32)}
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")  # llama.cpp's log: minutes.seconds.ms.us


def model_files(family: str, shape: str) -> tuple[Path, Path]:
    from kiln.frontend.pull import kiln_home

    folder = kiln_home() / "bench-vision" / (shape if family == "smolvlm" else f"{family}-{shape}")
    text, mmproj = folder / "text.gguf", folder / "mmproj.gguf"
    if not (text.is_file() and mmproj.is_file()):
        make_vlm.FAMILIES[family](folder / "hf", shape)
        make_vlm.convert(make_vlm.llama_cpp_source(), folder / "hf", folder)
    return text, mmproj


def image_size(family: str, shape: str) -> tuple[int, int]:
    return FAMILY_IMAGE_SIZES.get((family, shape), IMAGE_SIZES[shape])


def image(size: tuple[int, int], seed: int) -> Image.Image:
    return make_vlm.image(size, seed)  # one colour a seed: the same pixels after either server's resize


def data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def request(picture: Image.Image) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": PROMPT},
    ]
    body: dict[str, Any] = {
        "model": "bench",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    return body


def first_token_s(port: int, picture: Image.Image) -> float:
    """Seconds to the first token of a chat completion with `picture`: a request for one token, answered
    whole (a streamed first token may be part of a character, which llama-server holds back)."""
    body = request(picture) | {"max_tokens": 1}
    started = time.perf_counter()
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started


def greedy_ids(port: int, picture: Image.Image, llama_cpp: bool) -> list[int]:
    """The greedy token ids for `picture` and PROMPT: Kiln's chat completion naming them as vLLM does
    (return_tokens_as_token_ids); llama-server's /completion of its chat template's prompt, its media
    marker where the image goes (its chat logprobs leave out tokens that end mid-character)."""
    if llama_cpp:
        server = f"http://127.0.0.1:{port}"
        marker = httpx.get(f"{server}/props", timeout=60).json()["media_marker"]
        messages = [{"role": "user", "content": marker + PROMPT}]  # as llama-server joins the parts
        templated = httpx.post(f"{server}/apply-template", json={"messages": messages}, timeout=60)
        prompt = {"prompt_string": templated.json()["prompt"]}
        prompt["multimodal_data"] = [data_url(picture).split(",", 1)[1]]  # type: ignore[assignment]
        body = {"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        body |= {"return_tokens": True, "cache_prompt": False}
        reply = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=600)
        reply.raise_for_status()
        return list(reply.json()["tokens"])
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    reply = httpx.post(url, json=request(picture), timeout=600)
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["logprobs"]["content"]
    return [int(entry["token"].split(":")[1]) for entry in entries]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def llama_cpp_encode_ms(log: Path) -> list[float]:
    """Per request: the ms its image chunks (tiles) took to encode, each from its "encoding mtmd batch"
    line to its "decoding image batch" line."""

    def seconds(line: str) -> float:
        match = _STAMP.match(line)
        assert match is not None
        minutes, secs, millis, micros = (int(group) for group in match.groups())
        return minutes * 60 + secs + millis / 1e3 + micros / 1e6

    encodes: list[float] = []
    total, started = 0.0, None
    for line in log.read_text(errors="replace").splitlines():
        if not _STAMP.match(line):
            continue
        if "encoding mtmd batch" in line:
            started = seconds(line)
        elif "decoding image batch" in line and started is not None:
            total += seconds(line) - started
            started = None
        elif "prompt eval time" in line:
            encodes.append(total * 1000)
            total = 0.0
    return encodes


def run_server(
    name: str, command: list[str], port: int, size: tuple[int, int], seeds: list[int], log: Path
) -> dict[str, Any]:
    process, cold = start(command, port, log)
    try:
        first_token_s(port, image(size, 1000))  # warm: first-request costs (allocations) not timed
        ttfts = [first_token_s(port, image(size, seed)) for seed in seeds]
        tokens = [greedy_ids(port, image(size, seed), "llama" in name) for seed in seeds]
        rss = peak_rss_mib(process.pid)
    finally:
        stop(process)
    return {
        "name": name,
        "cold_start_s": cold,
        "ttft_s": statistics.median(ttfts),
        "tokens": tokens,
        "peak_rss_mib": rss,
    }


def kiln_encode_ms(text: Path, mmproj: Path, size: tuple[int, int], seeds: list[int]) -> float:
    from kiln.llm import LLM

    llm = LLM(str(text), mmproj=str(mmproj), show_progress=False)
    vision = llm.artifact.vision
    assert vision is not None
    vision.embed(image(size, 1000))
    times = []
    for seed in seeds:
        picture = image(size, seed)
        started = time.perf_counter()
        vision.embed(picture)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=sorted(make_vlm.FAMILIES), default="smolvlm")
    parser.add_argument("--shape", choices=sorted(make_vlm.SHAPES), default="256m")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="the images' seeds (default 0 .. runs - 1)"
    )
    parser.add_argument("--record", type=Path, default=None, help="write llama-server's greedy tokens here")
    args = parser.parse_args()
    seeds = args.seeds if args.seeds is not None else list(range(args.runs))
    text, mmproj = model_files(args.family, args.shape)
    size = image_size(args.family, args.shape)
    subprocess.run(  # compile into the cache before anything is timed
        [*KILN, "generate", str(text), "--mmproj", str(mmproj), "--prompt", "Hi", "--max-tokens", "1"],
        check=True,
    )
    work = text.parent
    port = free_port()
    kiln = run_server(
        "kiln serve",
        [*KILN, "serve", str(text), "--mmproj", str(mmproj), "--port", str(port), *SERVED],
        port,
        size,
        seeds,
        work / "kiln.log",
    )
    llama_command = [str(LLAMA_SERVER), "-m", str(text), "--mmproj", str(mmproj), "-t", str(args.threads)]
    llama_command += ["-c", "4096", "--port", str(port), "--alias", "bench", "-lv", "4"]
    llama = run_server(
        f"llama-server -t {args.threads}", llama_command, port, size, seeds, work / "llama.log"
    )
    kiln["encode_ms"] = kiln_encode_ms(text, mmproj, size, seeds)
    # requests whose image was encoded (a repeat of the same image is served from llama-server's
    # prompt cache), the warm-up image's first
    encodes = [ms for ms in llama_cpp_encode_ms(work / "llama.log") if ms > 0][1:]
    llama["encode_ms"] = statistics.median(encodes) if encodes else float("nan")

    print(f"\n{args.family} ({args.shape}, random weights), one {size} image, {len(seeds)} runs")
    print("| server | encode (ms) | TTFT (ms) | cold start (s) | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for row in (kiln, llama):
        print(
            f"| {row['name']} | {row['encode_ms']:.1f} | {row['ttft_s'] * 1000:.1f} | "
            f"{row['cold_start_s']:.2f} | {row['peak_rss_mib']:.0f} |"
        )
    print(
        f"Kiln / llama.cpp: encode {kiln['encode_ms'] / llama['encode_ms']:.2f}x, "
        f"TTFT {kiln['ttft_s'] / llama['ttft_s']:.2f}x (lower is better)"
    )
    same = kiln["tokens"] == llama["tokens"]
    print(f"greedy tokens equal on all {len(seeds)} images: {same}")
    distinct = len({tuple(tokens) for tokens in llama["tokens"]}) == len(seeds)
    print(f"each image's greedy tokens its own (the images told apart): {distinct}")
    if args.record is not None and distinct:
        fixture = {
            "made_by": f"bench/vision_peers.py --family {args.family} --shape {args.shape} "
            f"--seeds {' '.join(map(str, seeds))}: "
            + " ".join(Path(part).name if "/" in part else part for part in llama_command),
            "text_gguf_sha256": sha256(text),
            "mmproj_gguf_sha256": sha256(mmproj),
            "prompt": PROMPT,
            "images": [{"seed": seed, "size": size} for seed in seeds],
            "tokens": llama["tokens"],
        }
        args.record.write_text(json.dumps(fixture, indent=1) + "\n")
        print(f"wrote {args.record}")
    if args.record is not None and not distinct:
        raise SystemExit(f"two images gave the same greedy tokens, {args.record} not written: other --seeds")
    if not same:
        for index, (ours, theirs) in enumerate(zip(kiln["tokens"], llama["tokens"], strict=True)):
            if ours != theirs:
                print(f"image {index}: kiln {ours}\n          llama.cpp {theirs}")
        raise SystemExit("greedy tokens differ")


if __name__ == "__main__":
    main()
