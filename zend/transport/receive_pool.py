"""The receive pool: a received payload lands in a block the transport has used before.

Large fresh allocations cost page faults on every message, and UCX registers memory by
address (its registration cache maps a region once and finds it again by address; for
RDMA that registration is the expensive part). Keeping a small set of blocks whose
addresses stay the same makes both one-time costs. ucxx's Python API has no explicit
`ucp_mem_map`, so the pool relies on UCX's registration cache for the mapping itself.

A block is handed out as a tensor that views it; it becomes free again when every tensor
(and view) on it is gone. That is read from the block's reference count: the tensor holds a
numpy view, and the view holds the block, so no caller has to give anything back.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

MIN_POOLED_BYTES = 64 << 10  # below this a fresh allocation is as cheap (and never registered)


def _references(blocks: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(blocks[i])


@dataclass
class PoolStats:
    reused: int = 0  # payloads that landed in a block used before
    allocated: int = 0  # blocks created
    unpooled: int = 0  # payloads given fresh memory (small, or the pool was full)
    pooled_bytes: int = 0  # capacity of all blocks


class ReceivePool:
    """Blocks in power-of-two size classes, at most `max_bytes` of them in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.stats = PoolStats()
        self._blocks: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        # what a block nobody else holds counts, measured the same way the checks are made
        self._idle_references = _references([np.empty(0, dtype=np.uint8)], 0)

    def take(self, size: int) -> torch.Tensor:
        """A uint8 tensor of `size` bytes over a free block (or fresh memory)."""
        with self._lock:
            if size < MIN_POOLED_BYTES:
                self.stats.unpooled += 1
                return torch.empty(size, dtype=torch.uint8)
            capacity = 1 << (size - 1).bit_length()
            blocks = self._blocks.setdefault(capacity, [])
            for i in range(len(blocks)):
                if _references(blocks, i) == self._idle_references:
                    self.stats.reused += 1
                    return torch.from_numpy(blocks[i][:size])
            if self.stats.pooled_bytes + capacity <= self.max_bytes:
                block = np.empty(capacity, dtype=np.uint8)
                blocks.append(block)
                self.stats.allocated += 1
                self.stats.pooled_bytes += capacity
            else:
                self.stats.unpooled += 1
                return torch.empty(size, dtype=torch.uint8)
            return torch.from_numpy(block[:size])
