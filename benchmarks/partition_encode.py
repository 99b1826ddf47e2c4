"""CPU throughput of ZEN's push preparation: hash partition + encoding of every message.

Prints a table of million non-zero indices per second on one core (torch.set_num_threads(1)),
for element-sparse gradients (top-k style: 1-D, one value per index) of a 100M-element tensor,
and for row-sparse GPT-2-like embeddings. Target: >= 20 M indices/s.

    python benchmarks/partition_encode.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from zend.core.codec import encode_units
from zend.core.partition import ZenPartitioner
from zend.core.sparse import SparseGrad


def best_of(repeat: int, fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def case(num_rows: int, nnz: int, row_len: int, n: int, repeat: int) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(num_rows, generator=gen)[:nnz].sort().values
    values = torch.randn(nnz, row_len, generator=gen) if row_len > 1 else torch.randn(nnz, generator=gen)
    grad = SparseGrad(idx, values, num_rows, "bench", True)
    parts = ZenPartitioner(num_rows, row_len, n, seed=1)

    def partition_only() -> None:
        parts.split(grad)

    def partition_and_encode() -> None:
        for j, p in enumerate(parts.split(grad)):
            encode_units(p.keys, p.values, parts.domain_size(j))

    t_part = best_of(repeat, partition_only)
    t_all = best_of(repeat, partition_and_encode)
    return nnz / t_part / 1e6, nnz / t_all / 1e6, t_all * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [
        ("top-k 5% of 100M, n=16", 100_000_000, 5_000_000, 1, 16),
        ("top-k 5% of 100M, n=12", 100_000_000, 5_000_000, 1, 12),
        ("top-k 1% of 100M, n=128", 100_000_000, 1_000_000, 1, 128),
        ("GPT-2 embedding rows x768, n=16", 50_257, 13_000, 768, 16),
    ]
    print(f"{'case':<34} {'nnz idx':>10} {'partition M/s':>14} {'+encode M/s':>12} {'ms':>8}")
    for label, rows, nnz, width, n in cases:
        part, total, ms = case(rows, nnz, width, n, args.repeat)
        print(f"{label:<34} {nnz:>10,} {part:>14.1f} {total:>12.1f} {ms:>8.1f}")
    print("one core; best of", args.repeat, "runs; target >= 20 M indices/s for partition + encode")


if __name__ == "__main__":
    main()
