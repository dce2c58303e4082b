"""Shared test fixtures. The real-model ones skip, with the reason, where the model is not fetched."""

import io
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kiln.backends.base import Executable
from kiln.frontend.config import ModelConfig
from kiln.frontend.pull import kiln_home


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (`make test`: TEST_WORKERS processes) each worker, and the servers and ranks it
    starts, gets its share of the cores for TVM's and torch's thread pools. They spin while they wait:
    two workers each running every core's worth of threads made a TVM test 3-6x slower than on its
    share alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import torch

    share = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ.setdefault("TVM_NUM_THREADS", str(share))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(min(torch.get_num_threads(), share))


_share_cores_between_workers()


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
    from kiln.compiler.build import PipelineOptions, build_reference

    return build_reference(str(smollm2_gguf_path), PipelineOptions(opt_level=0))


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


def write_tokenizer_gguf(path: Path, tokenizer_keys: dict[str, Any]) -> Path:
    """A GGUF with just enough of a llama model around the given tokenizer metadata."""
    writer = gguf.GGUFWriter(path, "llama")
    n_vocab = len(tokenizer_keys["tokenizer.ggml.tokens"])
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_vocab_size(n_vocab)
    for key, value in tokenizer_keys.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((n_vocab, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_vocab(sp: Any) -> dict[str, Any]:
    """Tokens, scores and token types of a SentencePiece model as llama.cpp's converter writes them."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kinds = (sp.is_unknown(i), sp.is_control(i), sp.is_unused(i), sp.is_byte(i))
        types.append(next((code for code, hit in zip((2, 3, 5, 6), kinds, strict=True) if hit), 1))
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }


SPM_WORDS = (
    "the quick brown fox jumps over lazy dog river stone light bright night sight running jumped".split()
)


@pytest.fixture(scope="session")
def sentencepiece_model() -> Any:
    """A tiny SentencePiece BPE model (400 pieces, byte fallback) trained here on generated text."""
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choices(SPM_WORDS, k=rng.randint(3, 12))) + rng.choice(".!?,") for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture(scope="session")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory, sentencepiece_model: Any) -> Path:
    """A GGUF whose tokenizer is `sentencepiece_model` (tokenizer.ggml.model "llama")."""
    directory = tmp_path_factory.mktemp("spm")
    return write_tokenizer_gguf(directory / "tiny-spm.gguf", sentencepiece_vocab(sentencepiece_model))


@pytest.fixture(scope="session")
def gguf_writers() -> Any:
    """The helpers above, for tests that write GGUFs of their own."""
    from types import SimpleNamespace

    return SimpleNamespace(write=write_tokenizer_gguf, sentencepiece_vocab=sentencepiece_vocab)


def _check_batch_invariance(
    executable: Any, tokenizer: Any, model_id: str = "model", vocab: int = 49000
) -> None:
    """16 greedy requests (5 .. 140 prompt tokens, crossing block and chunk boundaries) give the same
    tokens one at a time, all batched with chunked prefill, and in a 24-block cache where preemption
    must happen (both asserted)."""
    import torch

    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.runtime.scheduler import SchedulerConfig

    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(min(100, vocab // 2), vocab, (5 + 9 * i,), generator=generator).tolist()
        for i in range(16)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def engine(num_blocks: int = 256) -> LLMEngine:
        config = EngineConfig(num_blocks=num_blocks, scheduler=SchedulerConfig(16, 64))
        return LLMEngine(executable, tokenizer, model_id, 2048, config)

    def run(target: LLMEngine, batch: list[list[int]]) -> dict[str, list[int]]:
        for i, prompt in enumerate(batch):
            target.add_request(f"r{i}", prompt, greedy)
        return {o.request_id: o.outputs[0].token_ids for o in target.run_to_completion()}

    alone = {f"r{i}": run(engine(), [prompt])["r0"] for i, prompt in enumerate(prompts)}
    together = engine()
    assert run(together, prompts) == alone
    assert together.stats.num_steps < sum(len(p) for p in prompts)  # prompts really were batched
    cramped = engine(num_blocks=24)  # 23 usable blocks of 16 tokens for 16 requests
    assert run(cramped, prompts) == alone
    assert cramped.scheduler.num_preemptions > 0


@pytest.fixture(scope="session")
def check_batch_invariance() -> Any:
    """The runtime's batch-invariance check, for any executable (see `_check_batch_invariance`)."""
    return _check_batch_invariance


# -- a tiny random-weight Llama on the reference backend, with a small word-level tokenizer: real engine
# steps in milliseconds, for tests that need many of them.

TINY_VOCAB = 96


def load_script(path: Path) -> Any:
    """A script of the repository (scripts/, examples/) imported as a module, by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=TINY_VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"


def _tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from kiln.runtime.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, TINY_VOCAB)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    data = json.loads(backend.to_str())
    data["added_tokens"] = [
        {
            "id": 1,
            "content": "</s>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    return Tokenizer(json.dumps(data), TINY_CHAT_TEMPLATE, None, "</s>", False, [1])


class FaultyExecutable(Executable):
    """Fault injection around a real executable: from step call `fail_at_step` on (None: never) its
    step raises RuntimeError; every step first sleeps `step_delay_s` (a slow device). It has no `embed`."""

    def __init__(self, inner: Any, fail_at_step: int | None, step_delay_s: float) -> None:
        self.inner = inner
        self.signature = inner.signature.with_entry_points(("step",), None)
        self.fail_at_step = fail_at_step
        self.step_delay_s = step_delay_s
        self.calls = 0

    def step(self, inputs: Any, kv_cache: Any) -> Any:
        self.calls += 1
        time.sleep(self.step_delay_s)
        if self.fail_at_step is not None and self.calls >= self.fail_at_step:
            raise RuntimeError(f"injected device fault in step call {self.calls}")
        return self.inner.step(inputs, kv_cache)


@pytest.fixture(scope="session")
def tiny_model() -> tuple[Any, Any]:
    """The tiny model's executable and tokenizer (whose chat template joins the messages' contents)."""
    from kiln.backends.reference import ReferenceExecutable
    from kiln.frontend.capture import capture_weights

    captured = capture_weights(TINY_CONFIG, tiny_weights())
    return ReferenceExecutable(captured.graph, captured.weights), _tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_draft_model() -> Any:
    """A draft for the tiny model, with its own KV cache shape: a third layer whose output projections
    are zero (so it adds nothing), and every weight the tiny model's plus noise, so that it agrees with
    the tiny model often but not always."""
    import dataclasses

    import torch

    from kiln.backends.reference import ReferenceExecutable
    from kiln.frontend.capture import capture_weights

    config = dataclasses.replace(TINY_CONFIG, num_hidden_layers=3)
    weights = tiny_weights()
    for name in [n for n in weights if n.startswith("model.layers.1.")]:
        silent = name.endswith(("o_proj.weight", "down_proj.weight"))
        extra = weights[name] * (0 if silent else 1)
        weights[name.replace("layers.1.", "layers.2.")] = extra
    generator = torch.Generator().manual_seed(1)
    noisy = {name: w + 0.02 * torch.randn(w.shape, generator=generator) for name, w in weights.items()}
    captured = capture_weights(config, noisy)
    return ReferenceExecutable(captured.graph, captured.weights)


def tiny_weights() -> dict[str, Any]:
    """The tiny Llama's random weights (seed 0)."""
    import torch

    from kiln.frontend.models import model_class

    with torch.device("meta"):
        shapes = model_class(TINY_CONFIG)(TINY_CONFIG).state_dict()
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(t.shape, generator=generator) * 0.5 for name, t in shapes.items()}


@pytest.fixture(scope="session")
def tiny_llama() -> tuple[ModelConfig, dict[str, Any]]:
    """(config, random weights) of the tiny Llama: no HF files, quick to capture and compile."""
    return TINY_CONFIG, tiny_weights()


@pytest.fixture
def make_tiny_engine(tiny_model) -> Any:
    """An LLMEngine (or `engine_class`) on the tiny model; with `fail_at_step` or `step_delay_s` its
    executable is a `FaultyExecutable` (`engine.executable.fail_at_step` can be moved later)."""
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.scheduler import SchedulerConfig

    def make(
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        fail_at_step: int | None = None,
        step_delay_s: float = 0.0,
        engine_class: type[LLMEngine] = LLMEngine,
        speculative: Any = None,
        draft: Any = None,
        max_step_ms: float | None = None,
        policy: str = "fcfs",
    ) -> LLMEngine:
        executable, tokenizer = tiny_model
        if fail_at_step is not None or step_delay_s:
            executable = FaultyExecutable(executable, fail_at_step, step_delay_s)
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
            scheduler=SchedulerConfig(
                max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, max_step_ms, policy
            ),
            speculative=speculative,
        )
        return engine_class(
            executable, tokenizer, "tiny", TINY_CONFIG.max_position_embeddings, config, draft=draft
        )

    return make


KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1")


def _random_gguf_blocks(ggml_type: str, rows: int, k: int, seed: int = 0, edges: bool = True) -> np.ndarray:
    """Random bytes in `ggml_type`'s blocks, every f16 field (d, dmin, m) a finite value of about 0.01;
    with `edges` also zeros, subnormals and the largest, so scales of every magnitude are imported."""
    from kiln.passes.quantize.gguf_kquants import KQUANTS
    from kiln.passes.quantize.quantizers import GGUF_BLOCKS

    kind = KQUANTS.get(ggml_type)  # else Q4_0, Q4_1, Q8_0: 32 values a block
    values_per_block, block_bytes = (
        (32, GGUF_BLOCKS[ggml_type][0]) if kind is None else (kind.values, kind.block_bytes)
    )
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // values_per_block, block_bytes), dtype=np.uint8)
    f16_fields = {
        "Q4_0": (0,),
        "Q4_1": (0, 2),
        "Q8_0": (0,),
        "Q4_K": (0, 2),
        "Q5_K": (0, 2),
        "Q6_K": (208,),
        "Q2_K": (80, 82),
        "Q3_K": (108,),
        "Q5_0": (0,),
        "Q5_1": (0, 2),
    }[ggml_type]
    edge = np.array([0.0, -0.0, 6e-8, -6e-5, 65504.0, -65504.0, 1.0, 1e-3], dtype=np.float16)
    for offset in f16_fields:
        values = rng.standard_normal(len(blocks)).astype(np.float16) * np.float16(0.01)
        if edges:
            values[: len(edge)] = edge
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="session")
def random_gguf_blocks() -> Any:
    return _random_gguf_blocks


def _hf_greedy(model: Any, prompt_ids: list[int], num_tokens: int, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers' greedy continuation of `prompt_ids` (up to `num_tokens`, stopping at `eos_ids`)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0],
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_greedy() -> Any:
    return _hf_greedy


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny random-weight transformers Llama with a word-level tokenizer, saved as a model folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    path = tmp_path_factory.mktemp("tiny_hf")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 64)}}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    ).save_pretrained(path)
    return path


AARCH64_PYTHON = Path(  # where scripts/aarch64_python.sh builds it: $KILN_HOME/aarch64-python
    os.environ.get("KILN_AARCH64_PYTHON")
    or Path(os.environ.get("KILN_HOME", Path.home() / ".cache" / "kiln")).expanduser() / "aarch64-python"
)
# qemu-aarch64's CPU model for a target's mcpu, so that an instruction the target lacks traps (qemu's
# default `max` has them all). qemu 7.2 (Debian bookworm) has no neoverse-v1: its i8mm runs on `max`.
QEMU_CPU = {"cortex-a76": "cortex-a76", "neoverse-n1": "neoverse-n1", "neoverse-v1": "max"}


@pytest.fixture(scope="session")
def qemu_env() -> Callable[[str], dict[str, str]]:
    """`qemu_env(mcpu)`: the environment for the emulated Python to run code built for `mcpu` as that CPU."""
    return lambda mcpu: {**os.environ, "QEMU_CPU": QEMU_CPU[mcpu]}


def missing_for_aarch64_emulation() -> str | None:
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        return "no aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu)"
    if shutil.which("qemu-aarch64") is None:
        return "no qemu-aarch64 (apt-get install qemu-user)"
    if not (AARCH64_PYTHON / "run").is_file():
        return f"no aarch64 Python at {AARCH64_PYTHON} (run scripts/aarch64_python.sh)"
    return None


@pytest.fixture
def aarch64_python() -> Path:
    """The emulated aarch64 Python's folder (its `run` starts it); skips, naming what is missing."""
    missing = missing_for_aarch64_emulation()
    if missing is not None:
        pytest.skip(missing)
    return AARCH64_PYTHON


# What a skip may name where every tool was set up (KILN_STRICT_SKIPS=1, as .ci/run sets it): hardware
# this machine lacks, or has. Any other skip (a model, a toolchain, an emulated Python that is
# missing) means the set-up failed, and fails the run.
HARDWARE_SKIPS = (
    "no NVIDIA GPU",
    "this machine has a GPU",
    "this machine's GPU is",
    "a GPU host",
    "this CPU lacks",
    "this CPU reports AMX",
    "AMX is x86-64's",
    "the refusal is of an aarch64 build on an x86-64 machine",
)


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr).removeprefix("Skipped: ")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("KILN_STRICT_SKIPS") != "1" or reporter is None:
        return
    reasons = {_skip_reason(r) for r in reporter.stats.get("skipped", []) if getattr(r, "skipped", False)}
    set_up_failures = sorted(r for r in reasons if not r.startswith(HARDWARE_SKIPS))
    if set_up_failures:
        reporter.ensure_newline()
        reporter.write_sep("=", "KILN_STRICT_SKIPS: skips that mean something was not set up", red=True)
        for reason in set_up_failures:
            reporter.write_line(reason, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    """llama.cpp's source with convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    folder = kiln_home() / "llama.cpp-source"
    found = sorted(folder.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        pytest.skip(
            f"no llama.cpp source under {folder}: run `bash scripts/llama_cpp_source.sh '' --python-only`"
        )
    return found[-1].parent


@pytest.fixture(scope="session")
def llama_cpp_mmproj(llama_cpp_source: Path) -> Callable[[Path, Path], Path]:
    """A function: the image-encoder GGUF llama.cpp's converter (--mmproj) writes for a HF directory."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "llama_cpp_convert.py"

    def convert(hf: Path, out: Path) -> Path:
        command = [sys.executable, str(script), str(llama_cpp_source), "gpt-2", str(hf), "--mmproj"]
        command += ["--outtype", "f32", "--outfile", str(out)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    return convert


def save_tiny_llava(
    folder: Path, *, strategy: str = "default", feature_layer: int = -2, with_tokenizer: bool = False
) -> Any:
    """A random-weight LlavaForConditionalGeneration (CLIP 28 x 28 in 7 x 7 patches, a 2-layer Llama of
    300 tokens, image token 299) saved at `folder`, norms, biases and embeddings random too so that a
    wrong mapping shows; returns the model. `with_tokenizer`: a whitespace tokenizer of words t1..t298
    and <image> (299), a chat template and a CLIP image processor's config too, as a servable model."""
    import torch
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=3,
        image_size=28,
        patch_size=7,
    )
    text = transformers.LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
        eos_token_id=2,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=299,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "embedding" in name:
                parameter.normal_(0, 0.5 if "bias" in name or "embedding" in name else 1.0)
    model.save_pretrained(folder)
    if with_tokenizer:
        save_word_tokenizer(folder, {**{f"t{i}": i for i in range(1, 299)}, "<image>": 299}, "t2")
        transformers.CLIPImageProcessor(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        ).save_pretrained(folder)
    return model


def save_word_tokenizer(
    folder: Path,
    words: dict[str, int],
    eos_token: str,
    special: list[str] | None = None,
    image_placeholder: str = "<image>",
) -> Any:
    """A whitespace tokenizer of `words` (and <unk>, id 0), decoded with spaces between words, with the
    tiny vision models' chat template (an image part written as `image_placeholder`), saved at `folder`;
    returns transformers' tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, **words}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # words joined by spaces
    extra = {"additional_special_tokens": special} if special else {}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token=eos_token, **extra
    )
    tokenizer.chat_template = TINY_LLAVA_CHAT_TEMPLATE.replace("<image>", image_placeholder)
    tokenizer.save_pretrained(folder)
    return tokenizer


# LLaVA-1.5's template's shape: an image part is its placeholder, then the text
TINY_LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image> {% else %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %} t3 {% endfor %}{% if add_generation_prompt %}t4 {% endif %}"
)


IDEFICS3_SPECIAL = [
    "<fake_token_around_image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)),
    "<end_of_utterance>",
    "<image>",
]  # ids 280..299


def save_tiny_idefics3(folder: Path) -> Any:
    """A random-weight Idefics3ForConditionalGeneration (SigLIP over 32 x 32 tiles of 4 x 4 patches, pixel
    shuffle by 2: 16 tokens a tile; a 2-layer Llama of 300 tokens, image token 299) saved at `folder` with
    a whitespace tokenizer (words t1..t279, Idefics3's special tokens 280..299), a chat template and an
    Idefics3 image processor (images up to 64 pixels a side: at most 2 x 2 tiles and the whole image);
    returns (model, transformers' Idefics3Processor)."""
    import torch
    import transformers

    vision = transformers.Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        image_size=32,
        patch_size=4,
    )
    text = transformers.LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=300,
        eos_token_id=298,
    )
    config = transformers.Idefics3Config(
        vision_config=vision, text_config=text, scale_factor=2, image_token_id=299, eos_token_id=298
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms and biases too, so a wrong mapping shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(1, 280)} | {token: 280 + i for i, token in enumerate(IDEFICS3_SPECIAL)}
    tokenizer = save_word_tokenizer(folder, vocab, "<end_of_utterance>", IDEFICS3_SPECIAL)
    images = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    images.save_pretrained(folder)
    processor = transformers.Idefics3Processor(images, tokenizer, image_seq_len=16)
    return model, processor


@pytest.fixture(scope="session")
def tiny_idefics3() -> Callable[..., Any]:
    return save_tiny_idefics3


GEMMA3_SPECIAL = ["<start_of_image>", "<end_of_image>", "<end_of_turn>", "<image_soft_token>"]  # 296..299


def save_tiny_gemma3(folder: Path) -> Any:
    """A random-weight Gemma3ForConditionalGeneration (SigLIP over 32 x 32 images of 4 x 4 patches,
    pooled to 16 tokens; a Gemma 3 text model of 300 tokens with a sliding layer of window 8 and a full
    one) saved at `folder` with a whitespace tokenizer (words t1..t295, Gemma 3's image tokens 296..299),
    a chat template and a Gemma 3 image processor; returns the model."""
    import torch
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        image_size=32,
        patch_size=4,
        vision_use_head=False,
    )
    text = transformers.Gemma3TextConfig(
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        head_dim=16,
        vocab_size=300,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=298,
    )
    config = transformers.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=16,
        boi_token_index=296,
        eoi_token_index=297,
        image_token_index=299,
        eos_token_id=298,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms, biases and projection too, so a wrong mapping shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "projection" in name:
                parameter.normal_(0, 0.5)
            if "input_projection" in name:  # llama.cpp's converter stores it as float16: no rounding then
                parameter.copy_(parameter.half().float())
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(1, 296)} | {token: 296 + i for i, token in enumerate(GEMMA3_SPECIAL)}
    save_word_tokenizer(folder, vocab, "<end_of_turn>", GEMMA3_SPECIAL, "<start_of_image>")
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_gemma3() -> Callable[..., Any]:
    return save_tiny_gemma3


@pytest.fixture(scope="session")
def tiny_llava() -> Callable[..., Any]:
    return save_tiny_llava


def llava_encoder_program(folder: Path) -> tuple[Any, Any]:
    """(ClipVisionConfig, Program) of the LLaVA checkpoint at `folder`'s image encoder, captured."""
    from safetensors.torch import load_file

    from kiln.frontend.capture import capture_module
    from kiln.frontend.models.clip_vision import (
        ClipVisionConfig,
        ClipVisionProjector,
        from_llava_weights,
        input_types,
    )
    from kiln.ir import Program

    config = ClipVisionConfig.from_llava(json.loads((folder / "config.json").read_text()))
    module = ClipVisionProjector(config)
    module.load_state_dict(from_llava_weights(config, load_file(folder / "model.safetensors")), strict=True)
    graph = capture_module(module.eval(), input_types(config), "encode_image")
    return config, Program(graph, {p.name: module.get_parameter(p.name).detach() for p in graph.params})


@pytest.fixture(scope="session")
def llava_encoder() -> Callable[[Path], tuple[Any, Any]]:
    return llava_encoder_program


@pytest.fixture(scope="session")
def compile_image_encoder() -> Callable[[Any, str, Path], Any]:
    """A function: the encoder `program` compiled at `folder` by "tvm" (CPU) or "onnxruntime", ready to
    `encode(inputs)`."""

    def compile_encoder(program: Any, backend: str, folder: Path) -> Any:
        if backend == "tvm":
            from kiln.backends.targets import Target
            from kiln.backends.tvm.encoder import TVMImageEncoder, compile_encoder

            compile_encoder(program.graph, Target("cpu"), folder)
            return TVMImageEncoder(folder, program.weights)
        from kiln.backends.onnxruntime.encoder import OrtImageEncoder
        from kiln.backends.onnxruntime.encoder import compile_encoder as compile_onnx

        compile_onnx(program, folder)
        return OrtImageEncoder(folder, program.weights)

    return compile_encoder


# -- LoRA adapters: tiny random-weight bases with random PEFT adapters, and llama.cpp's GGUFs of them ------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class TinyLoRAModel:
    """A tiny HF model (`kind`: llama or qwen2) and its adapters: PEFT folders, the GGUFs of the same."""

    kind: str
    base: Path
    adapters: dict[str, Path]
    gguf_adapters: dict[str, Path]

    def peft_model(self, adapter: str | None) -> Any:
        """transformers (+ peft) on the same weights, float32, eval mode: the reference."""
        import peft
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(
            self.base, attn_implementation="eager"
        ).eval()
        if adapter is None:
            return model
        return peft.PeftModel.from_pretrained(model, self.adapters[adapter]).eval()


def save_tiny_lora(base: Path, out: Path, seed: int, rank: int, **config: Any) -> Path:
    """A PEFT adapter of rank `rank` with random A and B (seed) on every attention and MLP linear."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    options = {"r": rank, "lora_alpha": 2 * rank, "target_modules": LORA_TARGETS, **config}
    adapted = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():  # B's random init is small next to these tiny weights: make the updates count
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.mul_(3.0)
    adapted.save_pretrained(out)
    return out


def convert_lora(llama_cpp_source: Path, base: Path, adapter: Path, out: Path) -> Path:
    """llama.cpp's convert_lora_to_gguf.py on a PEFT folder (float32)."""
    import subprocess
    import sys

    command = [sys.executable, str(llama_cpp_source / "convert_lora_to_gguf.py"), "--base", str(base)]
    command += ["--outtype", "f32", "--outfile", str(out), str(adapter)]
    env = {**os.environ, "PYTHONPATH": f"{llama_cpp_source}:{llama_cpp_source / 'gguf-py'}"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_lora_models(
    tmp_path_factory: pytest.TempPathFactory, llama_cpp_source: Path
) -> dict[str, TinyLoRAModel]:
    """A tiny Llama with adapters "r4" (rank 4), "r8" (rank 8) and "rs8" (rank 8, rsLoRA, attention only),
    and a tiny Qwen2 with "r4" and "r8"; each adapter also as llama.cpp's GGUF."""
    from tests.backends.conftest import save_tiny_hf

    models = {}
    for kind in ("llama", "qwen2"):
        folder = tmp_path_factory.mktemp(f"lora-{kind}")
        base = folder / "base"
        save_tiny_hf(kind, base)
        specs = {"r4": (1, 4, {}), "r8": (2, 8, {})}
        if kind == "llama":
            specs["rs8"] = (3, 8, {"use_rslora": True, "target_modules": ["q_proj", "v_proj", "o_proj"]})
        adapters = {
            name: save_tiny_lora(base, folder / name, seed, rank, **extra)
            for name, (seed, rank, extra) in specs.items()
        }
        ggufs = {
            name: convert_lora(llama_cpp_source, base, path, folder / f"{name}.gguf")
            for name, path in adapters.items()
        }
        models[kind] = TinyLoRAModel(kind, base, adapters, ggufs)
    return models
