"""Process-wide tuning for zen's own processes (simulator, benchmarks, the daemon)."""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def tune_allocator(max_arenas: int = 0) -> bool:
    """Keep freed memory in the heap instead of returning it to the kernel.

    Every sync allocates tensors of the same sizes again. With glibc's defaults, large blocks
    are mmap'ed and unmapped each time, and touching fresh pages costs a page fault each: on
    our machines that doubled the time to partition 5 M indices. Raising the mmap and trim
    thresholds lets the second sync reuse the first one's pages (what jemalloc or tcmalloc
    would also give). The price: memory freed by the process stays reserved by it.
    `max_arenas` (0: glibc's default) caps the malloc arenas: glibc gives other threads their
    own arenas, which these thresholds do not reach, so a process whose big tensors are made
    off the main thread (the daemon: receiver and handler threads) wants 1. The price there is
    a shared malloc lock, held briefly since big allocations are few.
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
    if max_arenas:
        ok &= mallopt(_M_ARENA_MAX, max_arenas)
    return bool(ok)


def tune_process(threads: int = 0) -> None:
    """What zen's long-running processes share a node with trainers under: a few torch threads
    (0: a quarter of the cores) and the allocator above with one arena."""
    import os

    import torch

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // 4))
    tune_allocator(max_arenas=1)
