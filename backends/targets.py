"""Target names: `cpu` (this host), `cpu:<llvm mcpu>`, `cuda:sm_XX`; and whether this machine fits one."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from kiln.errors import KilnError

CUDA_ARCHS = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90")
FLOAT8_MIN_ARCH = 89  # float8 e4m3 conversions in hardware from Ada (sm_89) on
FLOAT8_HINT = "drop --kv-cache-dtype fp8_e4m3 for that target, or compile for cuda:sm_89 / cuda:sm_90"
_MCPU = re.compile(r"^[a-z0-9][a-z0-9_\-.]*$")


class TargetError(KilnError):
    """A target name that does not parse, or an artifact whose target this machine is not."""


@dataclass(frozen=True)
class Target:
    kind: str  # "cpu" or "cuda"
    detail: str | None = None  # the mcpu for cpu targets, the sm arch for cuda targets

    @property
    def name(self) -> str:
        return self.kind if self.detail is None else f"{self.kind}:{self.detail}"

    @property
    def folder(self) -> str:
        """The artifact subfolder: the name with ':' (not portable in paths) as '-'."""
        return self.name.replace(":", "-")

    @property
    def gpu_arch(self) -> str | None:
        return self.detail if self.kind == "cuda" else None

    @classmethod
    def parse(cls, text: str) -> Target:
        kind, _, detail = text.strip().partition(":")
        if kind == "cpu" and (not detail or _MCPU.match(detail)):
            return cls("cpu", detail or None)
        if kind == "cuda" and detail in CUDA_ARCHS:
            return cls("cuda", detail)
        raise TargetError(
            f"unknown target {text!r}",
            hint=f"targets: cpu, cpu:<llvm mcpu> (e.g. cpu:znver4), cuda:<arch> for {', '.join(CUDA_ARCHS)}",
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
