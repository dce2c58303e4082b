"""Which x86 features a CPU artifact needs, and whether this CPU has them (read without LLVM)."""

from __future__ import annotations

from pathlib import Path

# The features whose absence means SIGILL: /proc/cpuinfo's name -> LLVM's name.
CHECKED_FEATURES = {
    "sse4_2": "sse4.2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512_vnni": "avx512vnni",
    "avx_vnni": "avxvnni",
}


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
