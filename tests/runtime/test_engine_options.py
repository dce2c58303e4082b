"""EngineOptions: every engine option declared once, the same for `kiln serve`, `kiln generate` and
kiln.LLM, validated when made."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from kiln.cli import build_parser
from kiln.errors import OptionsError
from kiln.llm import split_options
from kiln.runtime.config import EngineConfig
from kiln.runtime.engine_options import ARGUMENT_GROUP, EngineOptions, flag_name, parse_size
from kiln.runtime.kv_offload import KVOffloadConfig
from kiln.runtime.scheduler import SchedulerConfig
from kiln.runtime.speculative import SpeculativeConfig


def _command(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _engine_group(name: str) -> dict[str, argparse.Action]:
    (group,) = (g for g in _command(name)._action_groups if g.title == ARGUMENT_GROUP)
    return {action.option_strings[0]: action for action in group._group_actions}


def _help_entries(name: str) -> dict[str, str]:
    """Each engine flag's entry in the command's --help, as one line of words."""
    text = _command(name).format_help().split(f"{ARGUMENT_GROUP}:\n", 1)[1]
    entries = re.split(r"\n  (?=--)", "\n" + text.strip("\n"))
    return {entry.split()[0]: " ".join(entry.split()) for entry in entries if entry.strip()}


def test_serve_and_generate_take_the_engine_options_from_one_declaration_with_their_defaults() -> None:
    serve, generate = _engine_group("serve"), _engine_group("generate")
    for command, group in (("serve", serve), ("generate", generate)):
        declared = {
            flag_name(f.name)
            for f in dataclasses.fields(EngineOptions)
            if command in f.metadata["engine_flag"].commands
        }
        assert set(group) == declared
    assert set(generate) < set(serve)
    assert {"--max-model-len", "--max-num-seqs", "--kv-cache-memory", "--speculative-config"} <= set(generate)
    serve_help, generate_help = _help_entries("serve"), _help_entries("generate")
    for flag in generate:
        assert serve_help[flag] == generate_help[flag]
    for entry in serve_help.values():
        assert "(default: " in entry, entry
    assert "sequences per batch (default: 16)" in serve_help["--max-num-seqs"]
    assert "tokens per step (default: 512)" in serve_help["--max-num-batched-tokens"]
    assert "(default: fcfs)" in serve_help["--scheduling-policy"]


def test_the_flags_and_the_llm_keywords_are_the_options_fields(tmp_path: Path) -> None:
    args = _command("serve").parse_args(
        [
            "m",
            "--max-num-seqs",
            "4",
            "--num-kv-blocks",
            "64",
            "--kv-offload-dir",
            str(tmp_path),
            "--kv-offload-size",
            "1GiB",
            "--scheduling-policy",
            "priority",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ]
    )
    options = EngineOptions.from_args(args)
    assert options == EngineOptions(
        max_num_seqs=4,
        num_blocks=64,
        kv_offload_dir=str(tmp_path),
        kv_offload_size=2**30,
        scheduling_policy="priority",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},  # type: ignore[arg-type]
    )
    assert options.speculative_config == SpeculativeConfig("ngram", 2)
    plain = _command("generate").parse_args(["m", "--prompt", "hi"])
    assert EngineOptions.from_args(plain) == EngineOptions()
    model, engine = split_options("m", {"backend": "reference", "max_num_seqs": 2, "pooling": "mean"})
    assert (model.model, model.backend) == ("m", "reference")
    assert engine == EngineOptions(max_num_seqs=2, pooling="mean")


def test_the_defaults_are_the_runtimes() -> None:
    assert EngineOptions().engine_config(model_pooling=None, kv_offload_identity="") == EngineConfig()
    config = EngineOptions(max_step_ms=20.0).engine_config(model_pooling="mean", kv_offload_identity="")
    assert config.scheduler == SchedulerConfig(max_step_ms=20.0)
    assert config.pooling == "mean"
    assert EngineOptions(pooling="last").engine_config("mean", "").pooling == "last"
    offload = EngineOptions(kv_offload_cpu_size=2**20).engine_config(None, "artifact/cpu").kv_offload
    assert offload == KVOffloadConfig("artifact/cpu", None, 0, 2**20)


def test_contradictory_values_are_refused_when_the_options_are_made() -> None:
    with pytest.raises(OptionsError, match="kv_offload_size sizes the disk tier: give kv_offload_dir too"):
        EngineOptions(kv_offload_size=2**30)
    with pytest.raises(OptionsError, match="speculative config"):
        EngineOptions(speculative_config='{"method": "medusa"}')  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineOptions(max_num_seqs=0)
    with pytest.raises(ValueError, match="scheduling policy must be one of fcfs, priority"):
        EngineOptions(scheduling_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        EngineOptions(pooling="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        EngineOptions(num_blocks=1)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineOptions(max_lora_rank=0)


def test_an_unknown_llm_keyword_is_refused_naming_both_kinds_of_options() -> None:
    with pytest.raises(OptionsError, match="unknown option max_num_seq") as refused:
        split_options("m", {"max_num_seq": 4})
    assert "max_num_seqs" in str(refused.value.hint) and "kv_cache_dtype" in str(refused.value.hint)


@pytest.mark.parametrize(
    ("text", "size"),
    [("20GiB", 20 * 2**30), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9), ("1.5kb", 1500), ("4096", 4096)],
)
def test_sizes_are_read_with_their_units(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_size_without_a_known_unit_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        parse_size("20 parsecs")
