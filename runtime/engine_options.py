"""The one description of how a model is run: `EngineOptions`, built by `kiln serve` and `kiln generate`
from their flags (`add_engine_arguments`, `EngineOptions.from_args`), by `kiln.LLM` from its keywords,
and once for every model of a several-model server; validated once, when made.

Each option is declared once, here, with its flag (None: `kiln.LLM` alone takes it), its help and the
commands that take it: the CLI's arguments, their defaults in `--help` and `kiln.LLM`'s keywords all come
from these fields. `engine_config` makes the runtime's `EngineConfig` of them. What decides the compiled
code is a model option (compiler/options.py); what only the HTTP server needs stays with `kiln serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import OptionsError
from kiln.runtime.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN, EngineConfig
from kiln.runtime.kv_offload import KVOffloadConfig, default_disk_bytes
from kiln.runtime.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig
from kiln.runtime.pooling import POOLING_TYPES, PoolingType
from kiln.runtime.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    SCHEDULING_POLICIES,
    SchedulerConfig,
    SchedulingPolicy,
)
from kiln.runtime.speculative import SpeculativeConfig

SERVING = frozenset({"serve", "generate"})
SERVE = frozenset({"serve"})
LLM_ONLY: frozenset[str] = frozenset()
ARGUMENT_GROUP = "engine options"

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


@dataclass(frozen=True)
class EngineFlag:
    """How one engine option is asked for on the command line. `default`: how `--help` states the
    default where the value alone does not say it (None: the value, as argparse's %(default)s);
    `flag`: the flag's name where it is not the option's."""

    help: str
    type: Callable[[str], Any] = str
    choices: tuple[Any, ...] | None = None
    commands: frozenset[str] = SERVING
    default: str | None = None
    flag: str | None = None
    metavar: str | None = None

    @property
    def metadata(self) -> dict[str, EngineFlag]:
        """As a dataclass field's metadata."""
        return {"engine_flag": self}


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs one model; see the module doc. The KV cache holds `max_num_seqs` sequences of
    `max_model_len` tokens unless `kv_cache_memory` or `num_blocks` size it."""

    max_model_len: int | None = field(
        default=None,
        metadata=EngineFlag(
            "tokens per sequence", int, default=f"min(model's, {DEFAULT_MAX_MODEL_LEN})"
        ).metadata,
    )
    max_num_seqs: int = field(
        default=DEFAULT_MAX_NUM_SEQS, metadata=EngineFlag("sequences per batch", int).metadata
    )
    max_num_batched_tokens: int = field(
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metadata=EngineFlag("tokens per step", int).metadata
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata=EngineFlag("compute a long prompt in chunks over several steps", commands=LLM_ONLY).metadata,
    )
    max_step_ms: float | None = field(
        default=None,
        metadata=EngineFlag(
            "while streams decode, add only as many prompt tokens to a step as keep it under this many "
            "milliseconds, by the step times measured so far",
            float,
            default="twice the decode rows' own step",
        ).metadata,
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=EngineFlag(
            "the order requests start in: fcfs, in arrival order; priority, by each request's `priority` "
            "(smaller first), then arrival",
            choices=SCHEDULING_POLICIES,
            commands=SERVE,
        ).metadata,
    )
    block_size: int = field(
        default=DEFAULT_BLOCK_SIZE,
        metadata=EngineFlag("tokens a block of the KV cache holds", int, commands=LLM_ONLY).metadata,
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata=EngineFlag(
            "reuse the KV blocks of a prompt's prefix computed before", commands=LLM_ONLY
        ).metadata,
    )
    kv_cache_memory: int | None = field(
        default=None,
        metadata=EngineFlag(
            "the KV cache's size in bytes",
            int,
            default="max-num-seqs full-length sequences, at most half of the memory available",
            metavar="BYTES",
        ).metadata,
    )
    kv_cache_fraction: float | None = field(
        default=None,
        metadata=EngineFlag(
            "the most of the memory available now where the KV cache lives that it may take",
            float,
            commands=LLM_ONLY,
            default="0.5 of the host's, 0.9 of a GPU's free memory",
        ).metadata,
    )
    num_blocks: int | None = field(
        default=None,
        metadata=EngineFlag(
            f"the KV cache's size in blocks of {DEFAULT_BLOCK_SIZE} tokens",
            int,
            default="as its memory sizes it",
            flag="--num-kv-blocks",
        ).metadata,
    )
    kv_offload_dir: str | Path | None = field(
        default=None,
        metadata=EngineFlag(
            "keep prefix-cache blocks in this folder too: a restarted server (or another server of the same "
            "artifact sharing it) loads them back instead of recomputing (docs/runtime.md)",
            default="none",
        ).metadata,
    )
    kv_offload_size: int | None = field(
        default=None,
        metadata=EngineFlag(
            "the most the folder's blocks take, e.g. 20GiB",
            parse_size,
            default="16 GiB or half the disk's free space",
            metavar="SIZE",
        ).metadata,
    )
    kv_offload_cpu_size: int = field(
        default=0,
        metadata=EngineFlag(
            "host RAM that keeps blocks the KV cache evicts (for a KV cache on a GPU), e.g. 8GiB",
            parse_size,
            default="none",
            metavar="SIZE",
        ).metadata,
    )
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata=EngineFlag(
            'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_max": 4}\' (drafts from each sequence\'s own tokens) or \'{"model": '
            '"qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3}\' (drafts from a smaller model '
            "with the same vocabulary, compiled like the model)",
            default="none",
        ).metadata,
    )
    max_loras: int = field(
        default=DEFAULT_MAX_LORAS,
        metadata=EngineFlag("LoRA adapters one batch can mix", int, commands=SERVE).metadata,
    )
    max_lora_rank: int = field(
        default=DEFAULT_MAX_LORA_RANK,
        metadata=EngineFlag("the largest LoRA rank", int, commands=SERVE).metadata,
    )
    pooling: PoolingType | None = field(
        default=None,
        metadata=EngineFlag(
            "how /v1/embeddings pools the final hidden states: last (token) or mean",
            choices=POOLING_TYPES,
            commands=SERVE,
            default="the model's own pooling, else last",
        ).metadata,
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str | Mapping):
            object.__setattr__(self, "speculative_config", _speculative(self.speculative_config))
        if self.kv_offload_size is not None and not self.offloads_kv:
            raise OptionsError("kv_offload_size sizes the disk tier: give kv_offload_dir too")
        # the runtime's own configs check their values (a ValueError naming the value), once, here
        self.engine_config(model_pooling=None, kv_offload_identity="")
        self.lora_config()

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options, in declaration order: `kiln.LLM`'s keywords besides the model options."""
        return tuple(option.name for option in dataclasses.fields(cls))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options of a command line parsed with `add_engine_arguments` (the others keep their
        defaults)."""
        return cls(**{name: getattr(args, name) for name in cls.names() if hasattr(args, name)})

    def engine_config(self, model_pooling: PoolingType | None, kv_offload_identity: str) -> EngineConfig:
        """The runtime's settings. `model_pooling`: the model's own pooling (where `pooling` is not
        given); `kv_offload_identity`: the artifact and target the offloaded blocks belong to."""
        return EngineConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_fraction=self.kv_cache_fraction,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduler=SchedulerConfig(
                self.max_num_seqs,
                self.max_num_batched_tokens,
                self.enable_chunked_prefill,
                self.max_step_ms,
                self.scheduling_policy,
            ),
            speculative=self.speculative_config,
            kv_offload=self.kv_offload(kv_offload_identity),
            pooling=self.pooling or model_pooling or "last",
        )

    @property
    def offloads_kv(self) -> bool:
        """Whether full KV blocks also go to a lower tier (a folder, host RAM)."""
        return self.kv_offload_dir is not None or bool(self.kv_offload_cpu_size)

    def kv_offload(self, identity: str) -> KVOffloadConfig | None:
        """The prefix cache's lower tiers, for blocks of `identity` (None: none asked for)."""
        if not self.offloads_kv:
            return None
        disk = Path(self.kv_offload_dir) if self.kv_offload_dir is not None else None
        size = self.kv_offload_size
        disk_bytes = (size if size is not None else default_disk_bytes(disk)) if disk is not None else 0
        return KVOffloadConfig(identity, disk, disk_bytes, self.kv_offload_cpu_size)

    def lora_config(self) -> LoRAConfig:
        return LoRAConfig(self.max_loras, self.max_lora_rank)


def flag_name(option: str) -> str:
    flag: EngineFlag | None = _fields()[option].metadata.get("engine_flag")
    return flag.flag if flag is not None and flag.flag else "--" + option.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The engine options `command` takes, as flags in a group of their own, each with its default."""
    group = parser.add_argument_group(ARGUMENT_GROUP)
    for option in _fields().values():
        flag: EngineFlag = option.metadata["engine_flag"]
        if command not in flag.commands:
            continue
        default = flag.default if flag.default is not None else "%(default)s"
        group.add_argument(
            flag_name(option.name),
            dest=option.name,
            default=option.default,
            type=flag.type,
            choices=flag.choices,
            metavar=flag.metavar or (flag.flag and flag.flag.lstrip("-").replace("-", "_").upper()),
            help=f"{flag.help} (default: {default})",
        )


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {option.name: option for option in dataclasses.fields(EngineOptions)}


def _speculative(value: str | Mapping[str, Any]) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(value if isinstance(value, str) else dict(value))
    except (ValueError, TypeError) as error:
        raise OptionsError(
            f"speculative config {value!r}: {error}",
            hint='e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} or '
            '{"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3}',
        ) from None
