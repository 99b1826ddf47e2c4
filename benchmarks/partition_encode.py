"""CPU throughput of ZEN's push preparation: hash partition + encoding of every message.

Prints a table of million non-zero indices per second on one core (torch.set_num_threads(1)),
for element-sparse gradients (top-k style: 1-D, one value per index) of a 100M-element tensor,
and for row-sparse GPT-2-like embeddings, first with glibc's default allocator settings, then
with zend.runtime.tuning.tune_allocator() (what zen's own processes use).
Target (issue 12): >= 100 M indices/s at n = 16.

    python benchmarks/partition_encode.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from zend.core.partition import ZenPartitioner
from zend.core.schemes.parallel import ZenScheme
from zend.core.sparse import SparseGrad
from zend.runtime.tuning import tune_allocator


def best_of(repeat: int, fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def case(num_rows: int, nnz: int, row_len: int, n: int, repeat: int, device: str) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randperm(num_rows, generator=gen)[:nnz].sort().values
    values = torch.randn(nnz, row_len, generator=gen) if row_len > 1 else torch.randn(nnz, generator=gen)
    grad = SparseGrad(idx.to(device), values.to(device), num_rows, "bench", True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    parts = ZenPartitioner(num_rows, row_len, n, seed=1)

    def partition_only() -> None:
        parts.split(grad)
        sync()

    scheme = ZenScheme(seed=1)

    def partition_and_encode() -> None:  # every message rank 0 sends, made as the scheme's push makes them
        message, _, _ = scheme.prepare_push(parts, grad, 0)
        for j in range(1, n):
            message(j)
        sync()

    partition_and_encode()  # warm-up (CUDA kernels, allocator)

    t_part = best_of(repeat, partition_only)
    t_all = best_of(repeat, partition_and_encode)
    return nnz / t_part / 1e6, nnz / t_all / 1e6, t_all * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (default, one thread) or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [
        ("top-k 5% of 100M, n=16", 100_000_000, 5_000_000, 1, 16),
        ("top-k 5% of 100M, n=12", 100_000_000, 5_000_000, 1, 12),
        ("top-k 1% of 100M, n=128", 100_000_000, 1_000_000, 1, 128),
        ("GPT-2 embedding rows x768, n=16", 50_257, 13_000, 768, 16),
    ]
    print(f"{'case':<34} {'allocator':<9} {'nnz idx':>10} {'partition M/s':>14} {'+encode M/s':>12} {'ms':>8}")
    for allocator in ("default", "tuned"):
        if allocator == "tuned" and not tune_allocator():
            print("(glibc mallopt not available: no tuned rows)")
            break
        for label, rows, nnz, width, n in cases:
            part, total, ms = case(rows, nnz, width, n, args.repeat, args.device)
            print(f"{label:<34} {allocator:<9} {nnz:>10,} {part:>14.1f} {total:>12.1f} {ms:>8.1f}")
    where = "one CPU core" if args.device == "cpu" else args.device
    print(f"{where}; best of {args.repeat} runs; target >= 100 M indices/s for partition + encode on one core "
          "(issue 12)")


if __name__ == "__main__":
    main()
