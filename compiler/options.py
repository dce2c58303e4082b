"""The one description of what a user asked for: `ModelOptions`, built by the CLI (`from_args`), by
`kiln.LLM` (`create`) and so for the server, and validated once, before anything loads.

Each option is declared once, here, with its flag: the CLI's arguments, `kiln.LLM`'s keywords, the
manifest's `compile` fields and the compile cache's key all come from these fields. `auto` (and None,
"not given") is what `compiler.resolve` decides; nothing else turns it into a choice.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.backends.base import FLOAT8_KV_CACHE
from kiln.backends.registry import BACKEND_NAMES
from kiln.errors import OptionsError
from kiln.passes.base import DTYPES, GGUF_MIXES, KV_CACHE_DTYPES, QUANTIZATIONS
from kiln.runtime.artifact import read_manifest

DEFAULT_DTYPE = "f32"
DEFAULT_ACTIVATION_BITS = 16  # also what an artifact compiled before the option existed holds

AUTO = "auto"
COMMANDS = frozenset({"compile", "serve", "generate"})
PIPELINE_COMMANDS = frozenset({"compile", "tune", "inspect"})  # that build a graph
KV_CACHE_ALIASES = {"fp8": FLOAT8_KV_CACHE}  # vLLM's `fp8` is e4m3


@dataclass(frozen=True)
class Flag:
    """How one option is asked for on the command line; `compiled`: it decides the compiled code, so the
    manifest records it, the cache keys on it, and an artifact must hold what is asked."""

    help: str
    choices: tuple[Any, ...] | None = None
    type: Callable[[str], Any] = str
    commands: frozenset[str] = COMMANDS
    compiled: bool = False

    @property
    def metadata(self) -> dict[str, Flag]:
        """As a dataclass field's metadata."""
        return {"flag": self}


@dataclass(frozen=True)
class ModelOptions:
    """What was asked for one model; see the module doc. `model`: a known name, a GGUF file, a HF
    directory or an artifact folder."""

    model: str
    backend: str = field(
        default=AUTO,
        metadata=Flag(
            "auto (default): TVM for this CPU, or for the local GPU's sm_XX; reference: the interpreter",
            choices=(AUTO, *BACKEND_NAMES),
            compiled=True,
        ).metadata,
    )
    target: str | None = field(
        default=None,
        metadata=Flag(
            "cpu, cpu:<mcpu>, cuda:sm_80..sm_90; comma-separated for compile (default: this host)",
            commands=COMMANDS | {"tune"},
        ).metadata,
    )
    quantization: str = field(
        default=AUTO,
        metadata=Flag(
            "auto (default): a GGUF keeps its own quantized blocks, a float model stays float; q4_k_m, "
            "q5_k_m, q6_k, q8_0, q4_0: llama.cpp's blocks, as llama-quantize makes them of float weights",
            choices=(AUTO, "none", *QUANTIZATIONS, *GGUF_MIXES),
            commands=COMMANDS | PIPELINE_COMMANDS,
            compiled=True,
        ).metadata,
    )
    group_size: int = field(
        default=32,
        metadata=Flag(
            "int4 group size (32, 64 or 128)", (32, 64, 128), int, PIPELINE_COMMANDS, True
        ).metadata,
    )
    dtype: str = field(
        default=AUTO,
        metadata=Flag(
            "float dtype (default f32)",
            (AUTO, *DTYPES),
            commands=COMMANDS | PIPELINE_COMMANDS,
            compiled=True,
        ).metadata,
    )
    kv_cache_dtype: str = field(
        default=AUTO,
        metadata=Flag(
            "auto (default): f16 for TVM on CPUs with f32 activations, else the float dtype; f32, f16, "
            "bf16; fp8 / fp8_e4m3: float8 with per-layer scales calibrated at compile time (TVM backend; "
            "CPUs and sm_89+)",
            choices=(AUTO, *KV_CACHE_ALIASES, *KV_CACHE_DTYPES),
            compiled=True,
        ).metadata,
    )
    activation_bits: int | None = field(
        default=None,
        metadata=Flag(
            "TVM CPU quantized linears: activations quantized to 16 bits (default; greedy tokens as "
            "transformers float32) or 8 (llama.cpp's rounding: faster prefill and batches, logits further "
            "off)",
            choices=(16, 8),
            type=int,
            compiled=True,
        ).metadata,
    )
    opt_level: int = field(
        default=2, metadata=Flag("pass pipeline level", (0, 1, 2), int, PIPELINE_COMMANDS, True).metadata
    )
    tensor_parallel_size: int | None = field(
        default=None,
        metadata=Flag(
            "split the model over this many ranks, processes joined by gloo on this machine's CPU (default: "
            "an artifact's own, else 1); backends tvm and reference; GGUF blocks where they split on block "
            "boundaries (docs/passes.md)",
            type=int,
            compiled=True,
        ).metadata,
    )
    enable_lora: bool = field(
        default=False,
        metadata=Flag(
            "compile the step to take LoRA adapters as run-time data (PEFT folders, llama.cpp LoRA GGUFs) on "
            "the attention and MLP linears: see docs/lora.md",
            type=bool,
            commands=COMMANDS | PIPELINE_COMMANDS,
            compiled=True,
        ).metadata,
    )
    lora_dtype: str = field(
        default=AUTO,
        metadata=Flag(
            "the LoRA tables' dtype: auto (default): f16 for TVM on CPUs with f32 activations, else the "
            "float dtype; f32, f16, bf16",
            choices=(AUTO, *DTYPES),
            commands=COMMANDS | PIPELINE_COMMANDS,
            compiled=True,
        ).metadata,
    )
    mmproj: str | None = field(
        default=None,
        metadata=Flag(
            "a GGUF model's image encoder, as llama.cpp's converter writes it (--mmproj): the model then "
            "takes images (Idefics3 / SmolVLM, Gemma 3 files)",
        ).metadata,
    )
    tuning_logs: str | None = field(
        default=None,
        metadata=Flag(
            "MetaSchedule databases written by `kiln tune` (default: kiln's own tuning_logs/); none: skip",
            commands=frozenset({"compile", "tune"}),
        ).metadata,
    )
    num_threads: int | None = field(
        default=None,
        metadata=Flag(
            "CPU threads the artifact runs with (default: all)",
            type=int,
            commands=frozenset({"compile", "tune"}),
        ).metadata,
    )

    def __post_init__(self) -> None:
        for option in dataclasses.fields(self):
            flag = option.metadata.get("flag")
            value = getattr(self, option.name)
            if (
                flag is not None
                and flag.choices is not None
                and value is not None
                and value not in flag.choices
            ):
                raise OptionsError(
                    f"{option.name} {value!r} ({flag_name(option.name)}) is not one of "
                    f"{', '.join(map(str, flag.choices))}"
                )
        object.__setattr__(
            self, "kv_cache_dtype", KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        )
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise OptionsError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.enable_lora and (self.tensor_parallel_size or 1) > 1:
            raise OptionsError(
                "LoRA adapters are not split over tensor-parallel ranks",
                hint="drop --enable-lora, or use --tensor-parallel-size 1",
            )
        if self.kv_cache_dtype == FLOAT8_KV_CACHE and (self.tensor_parallel_size or 1) > 1:
            raise OptionsError(
                "a float8 KV cache is calibrated on the whole model, not per tensor-parallel rank",
                hint="drop --kv-cache-dtype, or use --tensor-parallel-size 1",
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options besides `model`, in declaration order."""
        return tuple(option.name for option in dataclasses.fields(cls) if option.name != "model")

    @classmethod
    def create(cls, model: str, **options: Any) -> ModelOptions:
        """From keywords; an unknown keyword is refused naming the known ones."""
        known = cls.names()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise OptionsError(f"unknown option {', '.join(unknown)}", hint=f"options: {', '.join(known)}")
        return cls(model, **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        """The options of a command line parsed with `add_arguments` (flags not given keep the defaults)."""
        given = {
            option.name: getattr(args, option.name)
            for option in dataclasses.fields(cls)
            if option.name != "model" and getattr(args, option.name, None) is not None
        }
        return cls(args.model, **given)

    def asked(self) -> dict[str, Any]:
        """The compiled options given explicitly (not auto, not left unset)."""
        return {
            name: value
            for name in compiled_options()
            if (value := getattr(self, name)) not in (None, AUTO) and value != _default(name)
        }


def compiled_options() -> tuple[str, ...]:
    """The options that decide the compiled code (`Flag.compiled`), in declaration order."""
    return tuple(
        option.name
        for option in dataclasses.fields(ModelOptions)
        if option.metadata.get("flag") is not None and option.metadata["flag"].compiled
    )


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The model options `command` takes, as flags (a flag not given stays None: the option's default)."""
    for option in dataclasses.fields(ModelOptions):
        flag: Flag | None = option.metadata.get("flag")
        if flag is None or command not in flag.commands:
            continue
        if flag.type is bool:
            parser.add_argument(
                flag_name(option.name), dest=option.name, action="store_const", const=True, help=flag.help
            )
            continue
        parser.add_argument(
            flag_name(option.name),
            dest=option.name,
            default=None,
            type=flag.type,
            choices=flag.choices,
            help=flag.help,
        )


def _default(name: str) -> Any:
    return next(option.default for option in dataclasses.fields(ModelOptions) if option.name == name)


def check_artifact_options(folder: Path, options: ModelOptions) -> None:
    """An artifact runs as it was compiled: compiled options asked for explicitly must be what it holds."""
    manifest = read_manifest(folder)
    held_options = {**_OLDER_MANIFESTS, **manifest["compile"]}
    backends = sorted({entry["backend"] for entry in manifest["targets"].values()})
    for name, value in options.asked().items():
        held = backends if name == "backend" else [_as_asked(name, held_options)]
        if value not in held:
            flag = flag_name(name)
            raise OptionsError(
                f"{folder} is an artifact compiled with {name} {', '.join(map(str, held))}, not {value}",
                hint=f"drop {flag} to run it as compiled, or compile the model again with {flag} {value}",
            )


# what a manifest means where it lacks a field (written before the option existed)
_OLDER_MANIFESTS = {
    "activation_bits": DEFAULT_ACTIVATION_BITS,
    "tensor_parallel_size": 1,
    "enable_lora": False,
}


def _as_asked(name: str, held_options: dict[str, Any]) -> Any:
    """A manifest's value as an option would ask for it (float weights: none; a KV cache in the float
    dtype: that dtype)."""
    held = held_options.get(name)
    if name in ("kv_cache_dtype", "lora_dtype") and held is None:
        return held_options.get("dtype", DEFAULT_DTYPE)
    return "none" if held is None else held


@dataclass(frozen=True)
class PipelineOptions:
    """What the pass pipeline is asked for: level, weight quantization (None, "int8", "int4", "gguf": a
    GGUF's own blocks), int4 group size, float dtype, KV cache dtype (None: the float dtype)."""

    opt_level: int = 2
    quantization: str | None = None
    group_size: int = 32
    dtype: str = "f32"
    context_len: int | None = None  # the longest sequence served (None: the model's own maximum)
    tensor_parallel_size: int = 1
    rank: int = 0  # the rank whose program is built, with tensor_parallel_size > 1
    kv_cache_dtype: str | None = None  # or "fp8_e4m3": a float8 cache with calibrated scales
    enable_lora: bool = False  # the step takes LoRA adapters (passes/lora.py)
    lora_dtype: str | None = None  # their tables' dtype (None: the float dtype)
