"""Make a random-weight Q4_K_M GGUF with the exact shapes of a real 7-8B model, with llama.cpp's own tools.

    .venv/bin/python scripts/make_shaped_gguf.py [--shape llama3-8b|qwen2.5-7b|tiny|tiny-qwen2]
        [--out PATH] [--work DIR] [--llama-cpp .venv-peers/llama.cpp] [--keep-intermediates]

The product (default `$KILN_HOME/models/shaped/<shape>-q4_k_m.gguf`) has the tensor shapes, types and
metadata of the real model converted and quantized the usual way, so it is for speed and memory
benchmarks and slow tests (the weights are noise; so is the text it writes). Steps, each skipped when its
output already exists and is complete, so that a rerun resumes:

1. an HF model folder under the work folder: `config.json` from transformers' `LlamaConfig`/`Qwen2Config`
   (the model itself is never instantiated), a tokenizer, and the weights as one safetensors shard per
   layer plus one for the embeddings and one for the norm and head, each shard's tensors drawn one by
   one from a generator seeded by (seed, shard) (normal, std 0.02; norms 1 + noise), saved and dropped;
2. llama.cpp's `convert_hf_to_gguf.py` (lazy: it streams tensors) to an F16 GGUF, with llama.cpp's own
   gguf-py;
3. `llama-quantize INTERMEDIATE OUT Q4_K_M THREADS`;
4. checks: kiln parses the header (config and tokenizer, without reading the weights) and
   `llama-bench -p 16 -n 4` runs the file; then the intermediates this script made are deleted unless
   `--keep-intermediates`. Each step's wall time and peak RSS are printed at the end.

No step holds the model in memory. Peak RSS for llama3-8b: 1.5 GB writing the HF folder, 1.5 GB
converting, 3.4 GB in llama-quantize (its own float32 buffer for the largest tensor, 2.1 GB for the
128256x4096 embedding, plus that tensor mapped in: no flag of its changes this), 0.8 GB for kiln's check
(llama-bench itself, running the model, maps the 4.6 GB file and repacks the weights: ~8 GB). The HF
weights are written as float16 rather than the real models' bfloat16: the converter widens a bfloat16
tensor to float32 before narrowing it again, which for the 128256x4096 embedding peaks at 4.4 GB, while
float16 in and `--outtype f16` out is copied straight from the memory-mapped shard (1.5 GB). Random
values of std 0.02 lose nothing in float16, and llama-quantize makes the same tensor types from either
(`--hf-dtype bfloat16` is there to check that, at the converter's 4.4 GB).

Tokenizer: no hub access, so the vocabulary is Qwen2.5's real byte-level BPE (tokens and merges read
from the Qwen2.5-Coder-0.5B GGUF that `kiln pull qwen2.5-coder-0.5b-instruct` fetches), written as a
`tokenizer.json` through the `tokenizers` library:

- qwen2.5-7b: Qwen's 151643 regular tokens, its 22 added tokens and [PAD] up to 152064 ids, Qwen2's
  pre-tokenizer: the real Qwen2.5 tokenizer, which the converter recognises by its hash as "qwen2";
- llama3-8b: Qwen's first 128000 tokens (BPE vocabularies are in merge order, so this is a complete BPE
  of 128000 tokens; merges that need a dropped token are dropped), then Llama 3's 256 special tokens at
  128000-128255 (<|begin_of_text|>, <|eot_id|>, ...), Llama 3's pre-tokenizer regex and chat template.
  No real vocabulary hashes like this one, so the converter is driven through scripts/llama_cpp_convert.py,
  which imports it as a module and replaces only its pre-tokenizer lookup (`get_vocab_base_pre`): a
  recognised hash must be the expected name, an unrecognised one becomes "llama-bpe" (how llama.cpp
  splits Llama 3 text). Everything else (vocab, merges, special tokens, chat template, GGUF layout) is
  the converter's own doing.

llama.cpp comes from `make bench-peers` (or `bash scripts/build_llama_cpp.sh .venv-peers/llama.cpp`):
its bin/ holds llama-quantize and llama-bench, its src/*/vendor/llama.cpp the converter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kiln.frontend.pull import kiln_home

if TYPE_CHECKING:
    import torch

THREADS = 2
SEED = 0
STD = 0.02
# The HF shards' dtype and the converter's --outtype for it. float16 by default: see the docstring.
OUTTYPES = {"float16": "f16", "bfloat16": "bf16"}
TOKENIZER_SOURCE = "qwen2.5-coder-0.5b-instruct"
MARKER = ".made-by-make_shaped_gguf"
SAMPLE_TEXT = "Hello world! Shapes of 8B models, 3.14159 and 12345678 tokens.\n\tdef f(x): return x"
LLAMA_BUILD_HINT = (
    "build it with `make bench-peers` or `bash scripts/build_llama_cpp.sh .venv-peers/llama.cpp`"
)


# -- shapes -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM"]
    tokenizer: Literal["llama3", "qwen2"]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "Qwen2ForCausalLM"


SHAPES: dict[str, Shape] = {
    shape.name: shape
    for shape in (
        Shape(
            "llama3-8b", "LlamaForCausalLM", "llama3", 4096, 32, 32, 8, 14336, 128256, 500000.0, 1e-5, 8192
        ),
        Shape("qwen2.5-7b", "Qwen2ForCausalLM", "qwen2", 3584, 28, 28, 4, 18944, 152064, 1e6, 1e-6, 32768),
        # fast end-to-end runs of the same pipeline and tokenizers
        Shape("tiny", "LlamaForCausalLM", "llama3", 256, 2, 4, 2, 512, 128256, 500000.0, 1e-5, 8192),
        Shape("tiny-qwen2", "Qwen2ForCausalLM", "qwen2", 256, 2, 4, 2, 512, 152064, 1e6, 1e-6, 32768),
    )
}


def parameter_count(shape: Shape) -> int:
    return sum(spec.numel for shard in shard_plan(shape) for spec in shard)


# -- tokenizer ----------------------------------------------------------------------------------------

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGULAR = 128000
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(4)),
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(5, 251)),
)
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp's token types


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE vocabulary: regular tokens (id = index), merges, then added tokens."""

    family: Literal["llama3", "qwen2"]
    regular: list[str]
    merges: list[tuple[str, str]]
    added: list[tuple[str, bool]]  # (text, special), ids following the regular tokens
    bos: str | None
    eos: str
    pad: str | None
    add_bos: bool
    chat_template: str

    @property
    def size(self) -> int:
        return len(self.regular) + len(self.added)

    def token_id(self, text: str) -> int:
        return len(self.regular) + [added for added, _ in self.added].index(text)


@dataclass(frozen=True)
class SourceVocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[tuple[str, str]]
    chat_template: str


def tokenizer_source_path() -> Path:
    folder = kiln_home() / "models" / TOKENIZER_SOURCE
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise SystemExit(
            f"error: no GGUF in {folder}: the tokenizer is taken from Qwen2.5-Coder-0.5B's vocabulary\n"
            f"  fix: `.venv/bin/kiln pull {TOKENIZER_SOURCE}` (or pass --tokenizer-from FILE.gguf)"
        )
    return found[0]


def read_source_vocabulary(path: Path) -> SourceVocabulary:
    """Qwen2.5's tokens, token types, merges and chat template from a GGUF's `tokenizer.*` keys."""
    fields = gguf.GGUFReader(path).fields

    def contents(key: str) -> Any:
        if key not in fields:
            raise SystemExit(f"error: {path} has no {key}: pass a Qwen2.5 GGUF as --tokenizer-from")
        return fields[key].contents()

    if contents("tokenizer.ggml.pre") != "qwen2":
        raise SystemExit(f"error: {path} is not a Qwen2 tokenizer: pass a Qwen2.5 GGUF as --tokenizer-from")
    return SourceVocabulary(
        tokens=list(contents("tokenizer.ggml.tokens")),
        types=[int(t) for t in contents("tokenizer.ggml.token_type")],
        merges=[merge_pair(merge) for merge in contents("tokenizer.ggml.merges")],
        chat_template=str(contents("tokenizer.chat_template")),
    )


def merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def regular_count(source: SourceVocabulary) -> int:
    """How many tokens come before the first added (non-normal) one."""
    return next(i for i, kind in enumerate(source.types) if kind != _NORMAL)


def llama3_vocabulary(source: SourceVocabulary) -> Vocabulary:
    """Qwen's first 128000 tokens, the merges among them, and Llama 3's 256 special tokens."""
    if regular_count(source) < LLAMA3_REGULAR:
        raise SystemExit(f"error: the tokenizer source has fewer than {LLAMA3_REGULAR} regular tokens")
    regular = source.tokens[:LLAMA3_REGULAR]
    kept = set(regular)
    merges = [(a, b) for a, b in source.merges if a in kept and b in kept and a + b in kept]
    return Vocabulary(
        family="llama3",
        regular=regular,
        merges=merges,
        added=[(text, True) for text in LLAMA3_SPECIALS],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        add_bos=True,
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )


def qwen2_vocabulary(source: SourceVocabulary) -> Vocabulary:
    """Qwen2.5's vocabulary as it is: regular tokens, all merges, its control and user-defined tokens."""
    n = regular_count(source)
    added = [
        (text, kind == _CONTROL)
        for text, kind in zip(source.tokens[n:], source.types[n:], strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    return Vocabulary(
        family="qwen2",
        regular=source.tokens[:n],
        merges=source.merges,
        added=added,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        add_bos=False,
        chat_template=source.chat_template,
    )


def make_vocabulary(shape: Shape, source: SourceVocabulary) -> Vocabulary:
    vocab = llama3_vocabulary(source) if shape.tokenizer == "llama3" else qwen2_vocabulary(source)
    if vocab.size > shape.vocab:
        raise SystemExit(
            f"error: {vocab.size} tokens do not fit the {shape.name} vocabulary of {shape.vocab}"
        )
    return vocab


def build_tokenizer(vocab: Vocabulary) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a Llama 3 / Qwen2 style tokenizer.json for `vocab`."""
    llama3 = vocab.family == "llama3"
    ids = {token: i for i, token in enumerate(vocab.regular)}
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=vocab.merges, ignore_merges=llama3))
    if not llama3:
        tokenizer.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(LLAMA3_REGEX if llama3 else QWEN2_REGEX), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if llama3 and vocab.bos is not None:
        bos = (vocab.bos, vocab.token_id(vocab.bos))
        template = processors.TemplateProcessing(
            single=f"{vocab.bos} $A", pair=f"{vocab.bos} $A {vocab.bos} $B", special_tokens=[bos]
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    for text, special in vocab.added:  # one at a time, so that each gets the next id
        token = AddedToken(text, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    check_added_ids(tokenizer, vocab)
    return tokenizer


def check_added_ids(tokenizer: Tokenizer, vocab: Vocabulary) -> None:
    for text, _ in vocab.added:
        if tokenizer.token_to_id(text) != vocab.token_id(text):
            raise RuntimeError(f"{text} got id {tokenizer.token_to_id(text)}, not {vocab.token_id(text)}")


def tokenizer_config(vocab: Vocabulary, shape: Shape) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.bos,
        "eos_token": vocab.eos,
        "pad_token": vocab.pad,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": shape.max_positions,
        "chat_template": vocab.chat_template,
    }


# -- HF folder ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dims: tuple[int, ...]
    init: Literal["weight", "norm", "bias"]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.dims:
            n *= dim
        return n


def layer_specs(shape: Shape, layer: int) -> list[TensorSpec]:
    p = f"model.layers.{layer}."
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    specs = [
        TensorSpec(p + "input_layernorm.weight", (shape.hidden,), "norm"),
        TensorSpec(p + "self_attn.q_proj.weight", (q, shape.hidden), "weight"),
        TensorSpec(p + "self_attn.k_proj.weight", (kv, shape.hidden), "weight"),
        TensorSpec(p + "self_attn.v_proj.weight", (kv, shape.hidden), "weight"),
        TensorSpec(p + "self_attn.o_proj.weight", (shape.hidden, q), "weight"),
        TensorSpec(p + "post_attention_layernorm.weight", (shape.hidden,), "norm"),
        TensorSpec(p + "mlp.gate_proj.weight", (shape.intermediate, shape.hidden), "weight"),
        TensorSpec(p + "mlp.up_proj.weight", (shape.intermediate, shape.hidden), "weight"),
        TensorSpec(p + "mlp.down_proj.weight", (shape.hidden, shape.intermediate), "weight"),
    ]
    if shape.qkv_bias:
        specs += [
            TensorSpec(p + f"self_attn.{x}_proj.bias", (n,), "bias")
            for x, n in (("q", q), ("k", kv), ("v", kv))
        ]
    return specs


def shard_plan(shape: Shape) -> list[list[TensorSpec]]:
    """Embeddings; one shard per layer; final norm and head (untied). Each under ~1.2 GB in 16 bits."""
    return [
        [TensorSpec("model.embed_tokens.weight", (shape.vocab, shape.hidden), "weight")],
        *(layer_specs(shape, layer) for layer in range(shape.layers)),
        [
            TensorSpec("model.norm.weight", (shape.hidden,), "norm"),
            TensorSpec("lm_head.weight", (shape.vocab, shape.hidden), "weight"),
        ],
    ]


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_files(shape: Shape) -> list[str]:
    """Every file this script writes into the HF folder (all that cleanup may delete there)."""
    count = len(shard_plan(shape))
    return ["config.json", *TOKENIZER_FILES, *(shard_name(i, count) for i in range(count)), INDEX_NAME]


def hf_config(shape: Shape, vocab: Vocabulary, dtype: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps,
        "tie_word_embeddings": False,
        "bos_token_id": vocab.token_id(vocab.bos) if vocab.bos else vocab.token_id("<|endoftext|>"),
        "eos_token_id": vocab.token_id(vocab.eos),
        "dtype": dtype,
    }
    if shape.architecture == "LlamaForCausalLM":
        config = LlamaConfig(**common, head_dim=shape.head_dim)
    else:
        config = Qwen2Config(**common, use_sliding_window=False, max_window_layers=shape.layers)
    config.architectures = [shape.architecture]
    return config


def make_tensor(spec: TensorSpec, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    import torch

    tensor = torch.randn(spec.dims, generator=generator, dtype=dtype).mul_(STD)
    return tensor.add_(1.0) if spec.init == "norm" else tensor


def write_shard(path: Path, specs: Sequence[TensorSpec], seed: int, dtype: str) -> None:
    """Draw the shard's tensors from a generator seeded by (seed, shard), save them, let them go."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {spec.name: make_tensor(spec, generator, getattr(torch, dtype)) for spec in specs}
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, partial, metadata={"format": "pt"})
    del tensors
    os.replace(partial, path)


def write_index(folder: Path, shape: Shape) -> None:
    plan = shard_plan(shape)
    weight_map = {spec.name: shard_name(i, len(plan)) for i, shard in enumerate(plan) for spec in shard}
    total = sum(spec.numel for shard in plan for spec in shard) * 2  # float16 and bfloat16 alike
    write_json(folder / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def hf_folder_complete(folder: Path, shape: Shape) -> bool:
    return all((folder / name).is_file() for name in hf_files(shape))


def write_hf_folder(folder: Path, shape: Shape, tokenizer_from: Path, seed: int, dtype: str) -> None:
    """Config, tokenizer, shards (those not yet written), and last the index that marks it complete."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_vocabulary(shape, read_source_vocabulary(tokenizer_from))
    hf_config(shape, vocab, dtype).save_pretrained(folder)
    build_tokenizer(vocab).save(str(folder / "tokenizer.json"))
    write_json(folder / "tokenizer_config.json", tokenizer_config(vocab, shape))
    plan = shard_plan(shape)
    for index, specs in enumerate(plan):
        path = folder / shard_name(index, len(plan))
        if path.is_file():
            continue
        write_shard(path, specs, seed * 1_000_003 + index, dtype)
        print(f"  {path.name}: {path.stat().st_size / 2**20:,.0f} MiB", flush=True)
    write_index(folder, shape)


# -- llama.cpp ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCpp:
    quantize: Path
    bench: Path
    source: Path  # holds convert_hf_to_gguf.py and gguf-py/

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"


def find_llama_cpp(root: Path) -> LlamaCpp:
    """The tools and converter of a `scripts/build_llama_cpp.sh` build at `root`, or a clear error."""
    tools = {name: root / "bin" / name for name in ("llama-quantize", "llama-bench")}
    missing = [str(path) for path in tools.values() if not path.is_file()]
    if missing:
        raise SystemExit(f"error: llama.cpp is not built: no {', '.join(missing)}\n  fix: {LLAMA_BUILD_HINT}")
    sources = sorted(root.glob("src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not sources:
        raise SystemExit(
            f"error: no llama.cpp source with convert_hf_to_gguf.py under {root}/src/*/vendor/llama.cpp\n"
            f"  fix: {LLAMA_BUILD_HINT} (it unpacks the source there)"
        )
    return LlamaCpp(tools["llama-quantize"], tools["llama-bench"], sources[-1].parent)


PRE_TOKENIZER = {"llama3": "llama-bpe", "qwen2": "qwen2"}


def converter_command(llama: LlamaCpp, hf: Path, out: Path, shape: Shape, outtype: str) -> list[str]:
    expected = PRE_TOKENIZER[shape.tokenizer]
    args = [str(hf), "--outfile", str(out), "--outtype", outtype, "--model-name", f"shaped {shape.name}"]
    wrapper = Path(__file__).with_name("llama_cpp_convert.py")  # the converter, its pre-tokenizer lookup set
    return [sys.executable, str(wrapper), str(llama.source), expected, *args]


def thread_env(threads: int) -> dict[str, str]:
    """This environment, with the CPU threads of every tool (torch, numpy) capped and the hub off."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
    }


def converter_env(llama: LlamaCpp, threads: int) -> dict[str, str]:
    """The converter imports llama.cpp's own gguf-py (and its `conversion` package), not the venv's gguf."""
    env = thread_env(threads)
    paths = [str(llama.source / "gguf-py"), str(llama.source)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
    return env


# -- running and measuring ----------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    wall_s: float = 0.0
    peak_rss_mib: float = 0.0
    skipped: bool = False
    note: str = ""


@dataclass
class Report:
    steps: list[Step] = field(default_factory=list)

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    def table(self) -> str:
        lines = [f"{'step':<30} {'wall':>9} {'peak RSS':>11}"]
        for s in self.steps:
            if s.skipped:
                lines.append(f"{s.name:<30} {'skipped':>9} {'':>11}  {s.note}")
            else:
                lines.append(f"{s.name:<30} {s.wall_s:>8.1f}s {s.peak_rss_mib:>7,.0f} MiB  {s.note}")
        return "\n".join(lines)


@contextmanager
def in_process(report: Report, name: str) -> Iterator[Step]:
    """Time a step run in this process; its peak RSS is this process's so far (RUSAGE_SELF)."""
    step = report.add(Step(name, note="in this process: RUSAGE_SELF ru_maxrss"))
    start = time.monotonic()
    yield step
    step.wall_s = time.monotonic() - start
    step.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# Runs a command and writes its RUSAGE_CHILDREN ru_maxrss to a file. A child inherits the high-water mark
# of the process it is forked from, so measuring from this small interpreter instead of the script (which
# may have held a big tokenizer) keeps the number the command's own.
MEASURED = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    out.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)
"""


def run_child(report: Report, name: str, command: Sequence[str], log: Path, env: dict[str, str]) -> Step:
    """Run `command` with its output in `log`; the step's peak RSS is that command's ru_maxrss."""
    print(f"[{name}] {' '.join(command)}", flush=True)
    step = report.add(Step(name, note="subprocess: RUSAGE_CHILDREN ru_maxrss"))
    rss = log.with_suffix(".maxrss")
    start = time.monotonic()
    with log.open("wb") as output:
        measured = [sys.executable, "-I", "-S", "-c", MEASURED, str(rss), *command]
        code = subprocess.run(
            measured, stdout=output, stderr=subprocess.STDOUT, env=env, check=False
        ).returncode
    step.wall_s = time.monotonic() - start
    if rss.is_file():
        step.peak_rss_mib = int(rss.read_text()) / 1024
        rss.unlink()
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"error: {name} failed (exit {code}); the last lines of {log}:\n" + "\n".join(tail))
    return step


# -- the steps ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    out: Path
    work: Path
    hf: Path
    intermediate: Path

    @classmethod
    def make(cls, shape: Shape, out: Path | None, work: Path | None, outtype: str) -> Paths:
        out = out or kiln_home() / "models" / "shaped" / f"{shape.name}-q4_k_m.gguf"
        work = work or out.parent / f"{out.stem}-work"
        return cls(out, work, work / "hf", work / f"{shape.name}-{outtype}.gguf")

    def logs(self) -> list[Path]:
        return [self.work / f"{name}.log" for name in ("hf", "convert", "quantize", "bench")]


def claim_work(work: Path) -> None:
    """Create the work folder, marking it as ours, so cleanup may later remove it (and only then)."""
    if not work.exists():
        work.mkdir(parents=True)
        (work / MARKER).write_text("made by scripts/make_shaped_gguf.py; deleted with its intermediates\n")


def check_disk(paths: Paths, shape: Shape) -> None:
    params = parameter_count(shape)
    need = 0
    if not paths.out.is_file():
        need += int(params * 0.62)  # Q4_K_M with a Q6_K head: ~4.9 bits a weight
        if not paths.intermediate.is_file():
            need += params * 2 * 2  # the 16-bit HF shards and the 16-bit GGUF
    free = shutil.disk_usage(paths.work if paths.work.exists() else paths.out.parent).free
    if need > free:
        raise SystemExit(
            f"error: making {paths.out} needs about {need / 1e9:.1f} GB free, {free / 1e9:.1f} GB left\n"
            "  fix: free space, or pass --work DIR / --out PATH on a larger disk"
        )


def step_hf(report: Report, paths: Paths, shape: Shape, args: argparse.Namespace) -> None:
    """Step 1 in a child process of its own (this script with --hf-only), so that its RSS is its own."""
    name = "1 HF folder (safetensors)"
    if hf_folder_complete(paths.hf, shape):
        report.add(Step(name, skipped=True, note=f"{paths.hf} is complete"))
        return
    tokenizer_from = args.tokenizer_from or tokenizer_source_path()
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--shape",
        shape.name,
        "--hf-only",
        str(paths.hf),
    ]
    command += [
        "--tokenizer-from",
        str(tokenizer_from),
        "--seed",
        str(args.seed),
        "--hf-dtype",
        args.hf_dtype,
    ]
    run_child(
        report,
        name,
        [*command, "--threads", str(args.threads)],
        paths.work / "hf.log",
        thread_env(args.threads),
    )


def step_convert(
    report: Report, paths: Paths, shape: Shape, llama: LlamaCpp, args: argparse.Namespace
) -> None:
    name = "2 convert_hf_to_gguf.py"
    if paths.intermediate.is_file():
        report.add(Step(name, skipped=True, note=f"{paths.intermediate} exists"))
        return
    partial = paths.intermediate.with_name(paths.intermediate.name + ".partial")
    command = converter_command(llama, paths.hf, partial, shape, OUTTYPES[args.hf_dtype])
    run_child(report, name, command, paths.work / "convert.log", converter_env(llama, args.threads))
    os.replace(partial, paths.intermediate)


def step_quantize(report: Report, paths: Paths, llama: LlamaCpp, threads: int) -> None:
    partial = paths.out.with_name(paths.out.name + ".partial")
    command = [str(llama.quantize), str(paths.intermediate), str(partial), "Q4_K_M", str(threads)]
    log = paths.work / "quantize.log"
    run_child(report, "3 llama-quantize Q4_K_M", command, log, thread_env(threads))
    os.replace(partial, paths.out)


def expected_config(shape: Shape) -> dict[str, Any]:
    return {
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": False,
    }


def check_in_kiln(path: Path, shape: Shape, hf: Path) -> None:
    """kiln parses the config and tokenizer (not the weights); they match the shape and the HF tokenizer."""
    from kiln.frontend.gguf_loader import config_from_gguf, open_gguf
    from kiln.frontend.gguf_tokenizer import tokenizer_info_from_gguf

    where = str(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, where)
    wrong = {k: (getattr(config, k), v) for k, v in expected_config(shape).items() if getattr(config, k) != v}
    if wrong:
        raise SystemExit(f"error: kiln reads {path} with a config unlike {shape.name}: (got, want) {wrong}")
    info = tokenizer_info_from_gguf(reader, where)
    ids = Tokenizer.from_str(info.tokenizer_json).encode(SAMPLE_TEXT, add_special_tokens=False).ids
    if Tokenizer.from_str(info.tokenizer_json).decode(ids) != SAMPLE_TEXT:
        raise SystemExit(f"error: kiln's tokenizer of {path} does not round-trip {SAMPLE_TEXT!r}")
    if (hf / "tokenizer.json").is_file():
        source = Tokenizer.from_file(str(hf / "tokenizer.json"))
        if (source_ids := source.encode(SAMPLE_TEXT, add_special_tokens=False).ids) != ids:
            raise SystemExit(f"error: kiln tokenizes the sample as {ids}, the HF tokenizer as {source_ids}")
    print(
        f"kiln: {config.architecture}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_attention_heads}/{config.num_key_value_heads}, ffn {config.intermediate_size}, "
        f"vocab {config.vocab_size}, rope_theta {config.rope_theta}; tokenizer bos {info.bos_token!r} "
        f"eos {info.eos_token!r} add_bos {info.add_bos_token}, {len(ids)} tokens for the sample text",
        flush=True,
    )


def print_histogram(path: Path) -> None:
    """The file's size and bytes by ggml type, as `kiln inspect` prints them, with tensor counts."""
    from kiln.frontend.gguf_header import bytes_by_type, gguf_tensor_types

    kinds = gguf_tensor_types(path)
    size = path.stat().st_size
    print(f"{path}: {size:,} bytes ({size / 2**30:.2f} GiB), {len(kinds)} tensors")
    by_type = bytes_by_type(path)
    print(
        "GGUF weights by type: "
        + ", ".join(f"{k} {v / 2**20:,.1f} MiB ({kinds.count(k)})" for k, v in by_type.items())
    )


def step_verify(report: Report, paths: Paths, shape: Shape, llama: LlamaCpp, threads: int) -> None:
    with in_process(report, "4a kiln: header + tokenizer"):
        check_in_kiln(paths.out, shape, paths.hf)
    print_histogram(paths.out)
    log = paths.work / "bench.log"
    command = [str(llama.bench), "-m", str(paths.out), "-p", "16", "-n", "4", "-t", str(threads)]
    run_child(report, "4b llama-bench -p 16 -n 4", command, log, thread_env(threads))
    rows = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("|")]
    if not any("pp16" in row for row in rows) or not any("tg4" in row for row in rows):
        raise SystemExit(f"error: llama-bench printed no pp16/tg4 rows; see {log}")
    print("\n".join(rows), flush=True)


def remove_intermediates(paths: Paths, shape: Shape) -> None:
    """Delete exactly the files this script writes, then its folders if they are empty and its own."""
    for name in hf_files(shape):
        (paths.hf / name).unlink(missing_ok=True)
    if paths.hf.is_dir() and not any(paths.hf.iterdir()):
        paths.hf.rmdir()
    paths.intermediate.unlink(missing_ok=True)
    for log in paths.logs():
        log.unlink(missing_ok=True)
    marker = paths.work / MARKER
    if marker.is_file() and [p.name for p in paths.work.iterdir()] == [MARKER]:
        marker.unlink()
        paths.work.rmdir()
    print(f"removed the intermediates under {paths.work}", flush=True)


# -- command line -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--out", type=Path, help="default: $KILN_HOME/models/shaped/<shape>-q4_k_m.gguf")
    parser.add_argument(
        "--work", type=Path, help="intermediates (default: <out stem>-work beside the output)"
    )
    parser.add_argument("--llama-cpp", type=Path, default=Path(".venv-peers/llama.cpp"), help="bin/ and src/")
    parser.add_argument("--tokenizer-from", type=Path, help=f"a Qwen2.5 GGUF (default: {TOKENIZER_SOURCE}'s)")
    parser.add_argument("--hf-dtype", choices=sorted(OUTTYPES), default="float16", help="see the docstring")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--keep-intermediates", action="store_true")
    parser.add_argument("--hf-only", type=Path, help=argparse.SUPPRESS)  # step 1 alone, into this folder
    return parser.parse_args(argv)


def write_hf_only(args: argparse.Namespace, shape: Shape) -> int:
    import torch

    torch.set_num_threads(args.threads)
    write_hf_folder(args.hf_only, shape, args.tokenizer_from, args.seed, args.hf_dtype)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    if args.hf_only:
        return write_hf_only(args, shape)
    llama = find_llama_cpp(args.llama_cpp.resolve())
    outtype = OUTTYPES[args.hf_dtype]
    paths = Paths.make(shape, args.out and args.out.resolve(), args.work and args.work.resolve(), outtype)
    print(f"{shape.name}: {parameter_count(shape) / 1e9:.2f}B parameters -> {paths.out}", flush=True)
    paths.out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(paths, shape)
    report = Report()
    total = time.monotonic()
    claim_work(paths.work)
    if paths.out.is_file():
        report.add(Step("1-3 make the GGUF", skipped=True, note=f"{paths.out} exists"))
    else:
        if not paths.intermediate.is_file():
            step_hf(report, paths, shape, args)
        step_convert(report, paths, shape, llama, args)
        step_quantize(report, paths, llama, args.threads)
    step_verify(report, paths, shape, llama, args.threads)
    if not args.keep_intermediates and paths.work.is_dir():
        remove_intermediates(paths, shape)
    print(report.table())
    print(f"total {time.monotonic() - total:.1f}s; {paths.out} ({paths.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
