"""Which x86-64 or aarch64 features a CPU artifact needs, and whether this CPU has them (read without
LLVM)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from kiln.backends.targets import host_machine

# The features whose absence means SIGILL: /proc/cpuinfo's name -> LLVM's name.
X86_64_FEATURES = {
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
    "amx_tile": "amx-tile",
    "amx_int8": "amx-int8",
}
AARCH64_FEATURES = {
    "asimd": "neon",
    "asimdhp": "fullfp16",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
}


def checked_features(machine: str) -> dict[str, str]:
    return AARCH64_FEATURES if machine == "aarch64" else X86_64_FEATURES


# aarch64 features from the kernel's hardware capabilities (getauxval), by (AT_HWCAP or AT_HWCAP2, bit):
# /proc/cpuinfo's names, and right where /proc/cpuinfo is not the CPU's (qemu-user shows the host's).
AT_HWCAP, AT_HWCAP2 = 16, 26
AARCH64_HWCAPS = {
    "asimd": (AT_HWCAP, 1),
    "asimdhp": (AT_HWCAP, 10),
    "asimddp": (AT_HWCAP, 20),
    "sve": (AT_HWCAP, 22),
    "sve2": (AT_HWCAP2, 1),
    "i8mm": (AT_HWCAP2, 13),
    "bf16": (AT_HWCAP2, 14),
}


def aarch64_flags() -> set[str]:
    libc = ctypes.CDLL(None)
    libc.getauxval.restype = ctypes.c_ulong
    libc.getauxval.argtypes = [ctypes.c_ulong]
    return {name for name, (at, bit) in AARCH64_HWCAPS.items() if libc.getauxval(at) >> bit & 1}


def host_flags() -> set[str]:
    if host_machine() == "aarch64":
        return aarch64_flags()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# Linux keeps AMX's tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA); a VM
# may report amx_tile in /proc/cpuinfo and still refuse.
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def enable_amx() -> bool:
    """Ask the kernel for AMX tile data for this process (once: the grant is the process's); True when
    granted (x86-64 Linux with AMX)."""
    if host_machine() != "x86_64" or "amx_tile" not in host_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def missing_features(required: list[str]) -> list[str]:
    flags = host_flags()
    if not flags:  # not Linux, or unreadable: nothing to compare against
        return []
    missing = [feature for feature in required if feature not in flags]
    if "amx_tile" in required and "amx_tile" not in missing and not enable_amx():
        missing.append("amx_tile (reported, but the kernel does not enable its tile data)")
    return missing
