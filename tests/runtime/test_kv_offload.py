"""KV offload on the engine: greedy tokens are the same whether a prefix was computed, reused from the
pool or restored from the disk tier (a new engine on the same folder: a restart), on the reference and
TVM, float32 and float8 KV; faulty block files are counted and recomputed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiln.backends.base import Executable
from kiln.backends.reference import ReferenceExecutable
from kiln.compiler.build import PipelineOptions, optimize
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine import LLMEngine
from kiln.runtime.kv_offload import KVOffloadConfig, TieredKVOffload
from kiln.runtime.kv_tiers import SUFFIX
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import SchedulerConfig
from tests.conftest import TINY_CONFIG, tiny_weights

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(41)]  # 10 full blocks and a token
QUESTION = [11, 12, 13, 14, 15, 16]
MAX_TOKENS = 12


def _program(kv_cache_dtype: str | None) -> Any:
    options = PipelineOptions(opt_level=2, kv_cache_dtype=kv_cache_dtype)
    return optimize(TINY_CONFIG, tiny_weights(), options).program


def _tvm(program: Any, folder: Path) -> Executable:
    from kiln.backends.base import CompileSettings
    from kiln.backends.targets import Target
    from kiln.backends.tvm.backend import TVMBackend

    backend = TVMBackend()
    backend.compile(program, Target("cpu"), folder, CompileSettings())
    return backend.load(folder, program.weights, Target("cpu"))


def _engine(executable: Executable, tokenizer: Any, folder: Path | None, identity: str = "tiny") -> LLMEngine:
    offload = KVOffloadConfig(identity, folder, 2**30) if folder is not None else None
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=64,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        kv_offload=offload,
    )
    return LLMEngine(executable, tokenizer, "tiny", TINY_CONFIG.max_position_embeddings, config)


def _greedy(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """The tokens, and the prompt tokens it did not compute."""
    request_id = f"r{engine.stats.num_steps}-{len(engine.requests)}-{id(prompt)}"
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    (output,) = engine.run_to_completion()
    return output.outputs[0].token_ids, output.num_cached_tokens


def _flush(engine: LLMEngine) -> TieredKVOffload:
    assert isinstance(engine.offload, TieredKVOffload)
    engine.offload.flush()
    return engine.offload


def _disk(engine: LLMEngine) -> Any:
    stats = engine.offload_stats()
    assert stats is not None
    return stats.tiers["disk"]


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob(f"*{SUFFIX}"))


def _check_computed_pooled_restored(executable: Executable, tokenizer: Any, folder: Path) -> None:
    computed, _ = _greedy(_engine(executable, tokenizer, None), PROMPT + QUESTION)
    first = _engine(executable, tokenizer, folder)
    assert _greedy(first, PROMPT) == (_greedy(_engine(executable, tokenizer, None), PROMPT)[0], 0)
    pooled, pool_hits = _greedy(first, PROMPT + QUESTION)
    assert pool_hits == 40 and pooled == computed
    _flush(first)
    first.close()
    assert len(_files(folder)) >= 10
    restarted = _engine(executable, tokenizer, folder)
    restored, hits = _greedy(restarted, PROMPT + QUESTION)
    assert hits == 44  # the prompt's 10 blocks and the first question block
    assert restored == computed
    assert _disk(restarted).hits == 11 and not _disk(restarted).failures
    restarted.close()


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_reference_tokens_are_the_same_computed_pooled_and_restored(
    kv_cache_dtype: str | None, tiny_model: Any, tmp_path: Path
) -> None:
    program = _program(kv_cache_dtype)
    executable = ReferenceExecutable(program.graph, program.weights)
    assert executable.kv_cache_spec.dtype == ("f8e4m3" if kv_cache_dtype else "f32")
    _check_computed_pooled_restored(executable, tiny_model[1], tmp_path / "kv")


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_tvm_tokens_are_the_same_computed_pooled_and_restored(
    kv_cache_dtype: str | None, tiny_model: Any, tmp_path: Path
) -> None:
    executable = _tvm(_program(kv_cache_dtype), tmp_path / "tvm")
    _check_computed_pooled_restored(executable, tiny_model[1], tmp_path / "kv")


@pytest.fixture
def stored(tiny_model: Any, tmp_path: Path) -> tuple[Any, Path, list[int]]:
    """A folder holding the prompt's blocks; the tokens computed without any cache."""
    executable, tokenizer = tiny_model
    folder = tmp_path / "kv"
    engine = _engine(executable, tokenizer, folder)
    tokens, _ = _greedy(engine, PROMPT)
    _flush(engine)
    engine.close()
    return tiny_model, folder, tokens


def _restart(model: Any, folder: Path) -> tuple[LLMEngine, list[int], int]:
    engine = _engine(*model, folder)
    tokens, hits = _greedy(engine, PROMPT)
    _flush(engine)
    return engine, tokens, hits


@pytest.mark.parametrize(
    ("fault", "damage"),
    [
        ("corrupt", lambda data: data[:-7] + bytes([data[-7] ^ 1]) + data[-6:]),
        ("truncated", lambda data: data[: len(data) // 2]),
    ],
)
def test_a_damaged_block_is_counted_recomputed_and_written_again(
    fault: str, damage: Any, stored: tuple[Any, Path, list[int]]
) -> None:
    model, folder, tokens = stored
    engine = _engine(*model, folder)
    chain = engine.kv.prefix_hashes(PROMPT, 10)
    victim = next(path for path in _files(folder) if path.stem == chain[3].hex())
    engine.close()
    victim.write_bytes(damage(victim.read_bytes()))
    engine, again, hits = _restart(model, folder)
    assert again == tokens and hits == 12  # blocks 0-2 restored, the rest recomputed
    assert _disk(engine).failures == {fault: 1}
    engine.close()
    engine, again, hits = _restart(model, folder)  # the recomputed block was written over the damaged one
    assert again == tokens and hits == 40 and not _disk(engine).failures
    engine.close()


def test_a_block_of_another_artifact_is_foreign(stored: tuple[Any, Path, list[int]]) -> None:
    model, folder, tokens = stored
    other = _engine(*model, folder, identity="another artifact")
    _greedy(other, PROMPT)
    _flush(other)
    other.close()
    (theirs,) = {path.parent.parent for path in _files(folder)} - {_disk_folder(model, folder)}
    ours = _disk_folder(model, folder)
    first = next(path for path in _files(theirs) if path.name in {p.name for p in _files(ours)})
    (ours / first.relative_to(theirs)).write_bytes(first.read_bytes())  # their bytes under our name
    engine, again, hits = _restart(model, folder)
    assert again == tokens and hits < 40 and _disk(engine).failures == {"foreign": 1}
    engine.close()


def _disk_folder(model: Any, folder: Path) -> Path:
    engine = _engine(*model, folder)
    assert engine.offload is not None and isinstance(engine.offload, TieredKVOffload)
    assert engine.offload.disk is not None
    path = engine.offload.disk.folder
    engine.close()
    return path


def test_a_server_killed_while_writing_leaves_nothing_a_restart_uses_wrongly(
    tiny_model: Any, tmp_path: Path
) -> None:
    """A process killed in the middle of writing a block leaves its temporary file; the next start
    removes it (its writer is gone) and serves the same tokens."""
    folder = tmp_path / "kv"
    script = tmp_path / "writer.py"
    script.write_text(
        "import os, sys\n"
        "from kiln.runtime import kv_tiers\n"
        "real_put = kv_tiers.DiskTier.put\n"
        "count = [0]\n"
        "def put(self, block_hash, payload):\n"
        "    count[0] += 1\n"
        "    if count[0] == 6:\n"
        "        path = self.path_of(block_hash)\n"
        "        path.parent.mkdir(exist_ok=True)\n"
        "        temporary = path.with_name(f'.{path.stem}.{os.getpid()}.1.tmp')\n"
        "        temporary.write_bytes(bytes(payload)[: len(payload) // 2])\n"
        "        os.kill(os.getpid(), 9)\n"
        "    real_put(self, block_hash, payload)\n"
        "kv_tiers.DiskTier.put = put\n"
        "from tests.conftest import tiny_weights, _tiny_tokenizer, TINY_CONFIG\n"
        "from kiln.frontend.capture import capture_weights\n"
        "from kiln.backends.reference import ReferenceExecutable\n"
        "from tests.runtime.test_kv_offload import _engine, _greedy, PROMPT\n"
        "captured = capture_weights(TINY_CONFIG, tiny_weights())\n"
        "engine = _engine(ReferenceExecutable(captured.graph, captured.weights), _tiny_tokenizer(), "
        "__import__('pathlib').Path(sys.argv[1]))\n"
        "_greedy(engine, PROMPT)\n"
        "engine.offload.flush()\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script), str(folder)], env=env, cwd=root, timeout=120)
    assert done.returncode == -9
    (leftover,) = folder.rglob("*.tmp")
    assert len(_files(folder)) == 5
    engine = _engine(*tiny_model, folder)
    assert not leftover.exists()
    tokens, hits = _greedy(engine, PROMPT)
    reference, _ = _greedy(_engine(*tiny_model, None), PROMPT)
    assert tokens == reference and hits == 20 and not _disk(engine).failures
    engine.close()


def test_decoded_blocks_reach_the_disk_when_the_pool_evicts_them_or_at_close(
    tiny_model: Any, tmp_path: Path
) -> None:
    """A prompt's blocks are written at once; a reply's when the pool reuses their blocks, the rest when
    the engine closes: the next turn of the conversation (prompt + reply + more) is restored whole."""
    folder = tmp_path / "kv"
    engine = _engine(*tiny_model, folder)
    reply, _ = _greedy(engine, PROMPT)  # 41 + 12 tokens: 13 full blocks computed (the last token is not)
    _flush(engine)
    assert len(_files(folder)) == 10
    engine.kv.pool.allocate(engine.kv.pool.num_free)  # another request takes every block: all evicted
    assert len(_files(folder)) >= 10
    _flush(engine)
    assert len(_files(folder)) == 13
    engine.close()
    conversation = PROMPT + reply + QUESTION
    restarted = _engine(*tiny_model, folder)
    tokens, hits = _greedy(restarted, conversation)
    assert hits == 13 * BLOCK_SIZE and not _disk(restarted).failures
    assert tokens == _greedy(_engine(*tiny_model, None), conversation)[0]
    restarted.close()

    before = len(_files(folder))
    engine = _engine(*tiny_model, folder)
    _greedy(engine, [5, 6, 7, 8] * 6)  # 24 + 12 tokens: 6 prompt blocks now, 2 of the reply at close
    _flush(engine)
    assert len(_files(folder)) == before + 6
    engine.close()
    assert len(_files(folder)) == before + 8


def test_two_engines_sharing_a_folder_find_each_others_blocks(tiny_model: Any, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    first, second = _engine(*tiny_model, folder), _engine(*tiny_model, folder)  # both indexed it empty
    tokens, _ = _greedy(first, PROMPT)
    _flush(first)
    again, hits = _greedy(second, PROMPT)
    assert again == tokens and hits == 40 and _disk(second).hits == 10
    first.close()
    second.close()


def test_a_sleep_keeps_the_prefix_on_disk_and_new_weights_never_read_it(
    tiny_model: Any, tmp_path: Path
) -> None:
    engine = _engine(*tiny_model, tmp_path / "kv")
    tokens, _ = _greedy(engine, PROMPT)
    engine.sleep(1)  # the pool is dropped; its blocks were handed to the disk first
    engine.wake_up()
    assert _greedy(engine, PROMPT) == (tokens, 40) and _disk(engine).hits == 10
    engine.replace_executable(engine.executable, version=1)  # other weights: the chain starts elsewhere
    assert _greedy(engine, PROMPT) == (tokens, 0) and _disk(engine).hits == 10
    engine.close()
