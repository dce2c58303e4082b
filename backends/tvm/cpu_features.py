"""Which x86 features a CPU artifact needs, and whether this CPU has them (read without LLVM)."""

from __future__ import annotations

from pathlib import Path

# LLVM feature names that /proc/cpuinfo spells the same way; the ones whose absence means SIGILL.
CHECKED_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")


def host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_features(required: list[str]) -> list[str]:
    flags = host_flags()
    if not flags:  # not Linux, or unreadable: nothing to compare against
        return []
    return [feature for feature in required if feature not in flags]
