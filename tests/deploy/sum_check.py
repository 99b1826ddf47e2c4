"""Run inside a trainer container (tests/deploy/test_containers.py mounts it): one known sparse
gradient per rank through this node's daemon, over the shared /run/zend volume (the daemon's memfd
buffers), and the exact sum back. Prints one JSON line; exits 1 if the sum is wrong."""

from __future__ import annotations

import json
import os
import sys

import torch
import zen

ROWS, DIM = 1000, 4


def gradient(rank: int) -> torch.Tensor:
    """Rank r touches rows r, 7 (every rank) and 100 + r, each with value r + 1."""
    rows = torch.tensor([[rank, 7, 100 + rank]])
    return torch.sparse_coo_tensor(rows, torch.full((3, DIM), float(rank + 1)), (ROWS, DIM))


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    expected = sum((gradient(r) for r in range(world)), torch.zeros(ROWS, DIM).to_sparse()).to_dense()
    with zen.Client() as client:
        client.wait_ready(120)
        out = client.allreduce(gradient(rank), name="deploy.sum_check").to_dense()
        stats = client.last_stats("deploy.sum_check")
    ok = torch.equal(out, expected)
    print(json.dumps({"rank": rank, "sum_ok": ok, "row7": out[7, 0].item(), "scheme": stats.scheme if stats else None,
                      "bytes_sent": stats.bytes_sent if stats else None}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
