"""Balance of ZEN's partition against the alternatives, on the real GPT-2 trace.

For each world size, the worst push imbalance (max over workers and partitions of
n * units sent there / units sent) and pull imbalance (max over partitions of n * aggregated
units / all aggregated units) over a few steps, for:
- zen/768, zen/64, zen/1: our partitioner for rows of 768 values (GPT-2 small), 64, and 1
  (element-sparse; the hash plus block rotation alone);
- hash/elem: the plain seeded hash of every row, no rotation (the paper's h0);
- hash/blk8, hash/blk64: hashing blocks of 8 or 64 consecutive rows, the cheap way to keep
  domain metadata small, which this table shows loses balance;
- ranges: even row ranges (sparse PS; OmniReduce at row granularity).

    python benchmarks/balance.py [--steps 3] [--nodes 4,8,16,32,64,128]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from zend.core.hashing import SeededHash
from zend.core.partition import ZenPartitioner
from zend.core.schemes.base import imbalance
from zend.core.sparse import SparseGrad
from zend.simulator.traces import TokenTrace

Assign = Callable[[torch.Tensor, int], list[int]]  # (rows, n) -> units per partition


def zen(width: int) -> Assign:
    def counts(rows: torch.Tensor, n: int) -> list[int]:
        parts = ZenPartitioner(50257, width, n, seed=11)
        grad_values = torch.zeros(len(rows), width)
        return [p.count for p in parts.split(SparseGrad(rows, grad_values, 50257, "g", True))]
    return counts


def hashed(block: int) -> Assign:
    def counts(rows: torch.Tensor, n: int) -> list[int]:
        return torch.bincount(SeededHash(11, n)(torch.div(rows, block, rounding_mode="floor")), minlength=n).tolist()
    return counts


def ranges(rows: torch.Tensor, n: int) -> list[int]:
    return torch.bincount(rows * n // 50257, minlength=n).tolist()


VARIANTS: dict[str, Assign] = {
    "zen/768": zen(768), "zen/64": zen(64), "zen/1": zen(1),
    "hash/elem": hashed(1), "hash/blk8": hashed(8), "hash/blk64": hashed(64), "ranges": ranges,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nodes", default="4,8,16,32,64,128")
    args = parser.parse_args()
    trace = TokenTrace.default()
    print(f"{'n':>4} " + " ".join(f"{name:>15}" for name in VARIANTS))
    print(f"{'':>4} " + " ".join(f"{'push / pull':>15}" for _ in VARIANTS))
    for n in (int(x) for x in args.nodes.split(",")):
        cells = []
        for assign in VARIANTS.values():
            push = pull = 1.0
            for step in range(args.steps):
                rows = [torch.from_numpy(trace.rows(w, step)) for w in range(n)]
                push = max(push, *(imbalance(assign(r, n)) for r in rows))
                pull = max(pull, imbalance(assign(torch.unique(torch.cat(rows)), n)))
            cells.append(f"{push:6.2f} / {pull:4.2f}")
        print(f"{n:>4} " + " ".join(f"{c:>15}" for c in cells))
    print(f"worst over {args.steps} steps; 1.00 is perfect balance; Jane Austen, GPT-2 BPE, 8x512 tokens per worker")


if __name__ == "__main__":
    main()
