"""Pages of memory-mapped files: give back the ones a process has read, keep the mapping.

Weights are read from mapped files (a GGUF at compile, an artifact's weights when serving). Pages a
process has touched count in its resident memory until the kernel reclaims them; a compile that reads
a 5 GB GGUF tensor by tensor would end up "holding" all of it. `let_go` unmaps a range's pages from
this process (MADV_DONTNEED): the page cache keeps them, and the next read faults them back in.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_MADV_DONTNEED = 4


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def let_go(array: np.ndarray) -> None:
    """Drop this process's resident pages of a read-only file mapping under `array` (a view of a
    np.memmap); anything else is left alone (DONTNEED would zero anonymous memory)."""
    if _LIBC is None or not isinstance(array, np.memmap) or array.flags.writeable or array.size == 0:
        return
    start = array.ctypes.data
    extents = [stride * (size - 1) for stride, size in zip(array.strides, array.shape, strict=True)]
    low = sum(e for e in extents if e < 0)
    high = sum(e for e in extents if e > 0)
    page = mmap.PAGESIZE
    first = -(-(start + low) // page) * page
    last = (start + high + array.itemsize) // page * page
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
