"""Target names: `cpu` (this host), `cpu:<llvm mcpu>`, `cuda:sm_XX`, each optionally `@<machine>` (the
machine the host code runs on); and whether this machine fits one."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

from kiln.errors import KilnError

CUDA_ARCHS = ("sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
BFLOAT16_MIN_ARCH = 80  # bfloat16 arithmetic from Ampere (sm_80) on
FLOAT8_MIN_ARCH = 89  # float8 e4m3 conversions in hardware from Ada (sm_89) on
FLOAT8_HINT = "drop --kv-cache-dtype fp8_e4m3 for that target, or compile for cuda:sm_89 / cuda:sm_90"
MACHINES = ("x86_64", "aarch64")
TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}
# The GPUs that only come in Jetson modules, whose CPUs are aarch64: Xavier (sm_72) and Orin (sm_87).
JETSON_ARCHS = ("sm_72", "sm_87")
# LLVM's aarch64 CPU names (`llc -mtriple=aarch64 -mcpu=help`); every other name is taken as x86-64.
_AARCH64_CPUS = re.compile(
    r"^(cortex-|neoverse-|apple-|ampere|carmel|thunderx|a64fx|exynos-|falkor|kryo|saphira|tsv110|oryon|"
    r"cyclone|grace)"
)
_MCPU = re.compile(r"^[a-z0-9][a-z0-9_\-.]*$")


class TargetError(KilnError):
    """A target name that does not parse, or an artifact whose target this machine is not."""


def host_machine() -> str:
    """This machine as `MACHINES` names it (arm64 is aarch64, amd64 is x86_64)."""
    machine = platform.machine().lower()
    return {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)


def default_machine(kind: str, detail: str | None) -> str | None:
    """The machine a target's host code is for when its name does not say: a Jetson GPU's aarch64, an
    aarch64 CPU's own, x86-64 for other GPUs and CPUs; None for `cpu` (whatever compiles it)."""
    if kind == "cuda":
        return "aarch64" if detail in JETSON_ARCHS else "x86_64"
    if detail is None:
        return None
    return "aarch64" if _AARCH64_CPUS.match(detail) else "x86_64"


@dataclass(frozen=True)
class Target:
    kind: str  # "cpu" or "cuda"
    detail: str | None = None  # the mcpu for cpu targets, the sm arch for cuda targets
    host: str | None = None  # the machine of the host code (MACHINES); None: the default for the name

    def __post_init__(self) -> None:
        if self.host is None:
            object.__setattr__(self, "host", default_machine(self.kind, self.detail))

    @property
    def name(self) -> str:
        base = self.kind if self.detail is None else f"{self.kind}:{self.detail}"
        return base if self.host == default_machine(self.kind, self.detail) else f"{base}@{self.host}"

    @property
    def folder(self) -> str:
        """The artifact subfolder: the name with ':' (not portable in paths) as '-'."""
        return self.name.replace(":", "-")

    @property
    def gpu_arch(self) -> str | None:
        return self.detail if self.kind == "cuda" else None

    @property
    def machine(self) -> str:
        """The machine the host code runs on (`cpu` without a CPU name: this one)."""
        return self.host or host_machine()

    @property
    def triple(self) -> str:
        return TRIPLES.get(self.machine, f"{self.machine}-unknown-linux-gnu")

    @classmethod
    def parse(cls, text: str) -> Target:
        spec, at, machine = text.strip().partition("@")
        kind, _, detail = spec.partition(":")
        if at and machine not in MACHINES:
            raise TargetError(
                f"unknown host machine {machine!r} in target {text!r}",
                hint=f"machines: {', '.join(MACHINES)}",
            )
        if kind == "cpu" and (not detail or _MCPU.match(detail)):
            return cls("cpu", detail or None, machine or None)
        if kind == "cuda" and detail in CUDA_ARCHS:
            return cls("cuda", detail, machine or None)
        raise TargetError(
            f"unknown target {text!r}",
            hint="targets: cpu, cpu:<llvm mcpu> (e.g. cpu:znver4, cpu:cortex-a76), cuda:<arch> for "
            f"{', '.join(CUDA_ARCHS)}; any of them @x86_64 or @aarch64 for the host code's machine",
        )


def parse_targets(text: str) -> list[Target]:
    targets = [Target.parse(part) for part in text.split(",") if part.strip()]
    if not targets:
        raise TargetError("no target given", hint="e.g. --target cpu or --target cuda:sm_87,cuda:sm_90")
    return list(dict.fromkeys(targets))


def host_gpu_arch() -> str | None:
    """This machine's first NVIDIA GPU as sm_XX, or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
    return "sm_" + first.replace(".", "") if first else None


def mismatch(target: Target) -> str | None:
    """Why this machine cannot run `target`, or None when it can."""
    here = host_machine()
    if target.machine != here:
        return (
            f"the artifact's host code is for {TRIPLES.get(target.machine, target.machine)} (target "
            f"{target.name}) but this machine is {TRIPLES.get(here, here)}"
        )
    if target.kind == "cpu":
        return None
    host = host_gpu_arch()
    if host is None:
        return f"the artifact is for {target.name} ({target.gpu_arch}) but this machine has no NVIDIA GPU"
    if host != target.gpu_arch:
        return f"the artifact is for {target.gpu_arch} but this machine's GPU is {host}"
    return None


def float8_kv_cache_refusal(target: Target) -> str | None:
    """Why `target` cannot hold a float8 KV cache, None where it can (CPUs convert in software)."""
    arch = target.gpu_arch
    if arch is not None and int(arch[3:]) < FLOAT8_MIN_ARCH:
        return (
            f"a float8 KV cache needs float8 conversions in hardware (sm_89 Ada and newer); "
            f"{target.name} has none"
        )
    return None


def bfloat16_refusal(target: Target) -> str | None:
    """Why `target` cannot run bfloat16, None where it can (CPUs convert in software)."""
    arch = target.gpu_arch
    if arch is not None and int(arch[3:]) < BFLOAT16_MIN_ARCH:
        return f"{target.name} has no bfloat16 arithmetic (sm_80 Ampere and newer do)"
    return None


def cross_compiler(target: Target) -> str | None:
    """The C compiler that links the target's host code where it is not for this machine, else None."""
    if target.machine == host_machine():
        return None
    return f"{target.machine}-linux-gnu-gcc"
