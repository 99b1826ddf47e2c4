"""Process-wide settings for zen's own processes (simulator, benchmarks, later the daemon)."""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_allocator() -> bool:
    """Keep freed memory in the heap instead of returning it to the kernel.

    Every sync allocates tensors of the same sizes again. With glibc's defaults, large blocks
    are mmap'ed and unmapped each time, and touching fresh pages costs a page fault each: on
    our machines that doubled the time to partition 5 M indices. Raising the mmap and trim
    thresholds lets the second sync reuse the first one's pages (what jemalloc or tcmalloc
    would also give). The price: memory freed by the process stays reserved by it.
    Returns False where glibc's mallopt is not available.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # blocks under 1 GiB come from the heap
    ok &= mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)  # never hand the top of the heap back
    ok &= mallopt(_M_TOP_PAD, 256 << 20)  # grow the heap in large steps
    return bool(ok)
