"""ZEN's cost model in bytes: what each scheme puts through the busiest rank's link.

All figures are per rank and per direction (sent = received for these symmetric schemes), for
a tensor of M rows of `row_bytes` bytes, n ranks, `mean_rows` non-zero rows per rank on
average and `union_rows` non-zero rows after summing all n (densification
gamma_n = union_rows / mean_rows). Index entries cost `index_bytes` in COO; a bitmap costs
one bit per row of the domain.

- Balanced parallelism (ZEN, perfectly balanced), the lower bound of our tables:
    (n-1)/n * [ mean_rows * (index_bytes + row_bytes)            push, COO
              + union_rows * row_bytes                            pull, values
              + min(union_rows * index_bytes, M / 8) ]            pull, cheaper index encoding
- Hierarchical centralization (recursive doubling), log2(n) rounds, round k sending the sum of
  2^(k-1) ranks: sum_k rows_k * row_bytes + min(rows_k * index_bytes, M / 8),
  rows_k = min(M, mean_rows * gamma(2^(k-1))), gamma(m) = m^alpha fitted to gamma_n.
- Dense ring allreduce: 2 * (n-1)/n * M * (row_bytes + 1/8) (values, and a bit per row: the rows sent).

Each formula is found through its scheme, the class's `bytes_per_rank` (zend.core.schemes), by
which auto prunes and picks: no table here lists the schemes. The exact count of every message
is another model, the simulator's (zend.simulator.traffic_model); an approximation is all auto needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """What the cost model needs to know about a tensor's sparsity, cluster-wide."""

    world_size: int
    num_rows: int
    row_bytes: int
    mean_rows: float
    union_rows: float
    index_bytes: int = 4

    @property
    def density(self) -> float:
        return self.mean_rows / self.num_rows if self.num_rows else 0.0

    @property
    def densification(self) -> float:
        return self.union_rows / self.mean_rows if self.mean_rows else 1.0


def bytes_balanced_parallel(p: Profile) -> float:
    n = p.world_size
    if n == 1:
        return 0.0
    index = min(p.union_rows * p.index_bytes, p.num_rows / 8)
    return (n - 1) / n * (p.mean_rows * (p.index_bytes + p.row_bytes) + p.union_rows * p.row_bytes + index)


def gamma_at(p: Profile, m: int) -> float:
    """Densification after summing m ranks, interpolated as m^alpha through gamma_n."""
    if p.world_size <= 1 or m <= 1:
        return 1.0
    alpha = math.log(max(p.densification, 1.0)) / math.log(p.world_size)
    return float(m**alpha)


def bytes_hierarchical(p: Profile) -> float:
    total = 0.0
    for k in range(1, math.ceil(math.log2(p.world_size)) + 1 if p.world_size > 1 else 1):
        rows = min(float(p.num_rows), p.mean_rows * gamma_at(p, 2 ** (k - 1)))
        total += rows * p.row_bytes + min(rows * p.index_bytes, p.num_rows / 8)
    return total


def dense_ring_bytes(world_size: int, tensor_bytes: int) -> int:
    """Bytes each rank sends in a ring allreduce of a dense tensor: reduce-scatter, then allgather,
    each (n-1)/n of the tensor. Also what the daemon reports as a step's dense equivalent."""
    return 2 * (world_size - 1) * tensor_bytes // world_size


def bytes_dense(p: Profile) -> float:
    """The ring of values, and the ring of row bitmaps that keeps the rows sent (schemes.rowset)."""
    return float(dense_ring_bytes(p.world_size, p.num_rows * p.row_bytes) + dense_ring_bytes(p.world_size,
                                                                                             (p.num_rows + 7) // 8))


def bytes_allgather(p: Profile) -> float:
    """Ring allgather of every rank's COO (agsparse, gloo): each rank receives n - 1 gradients."""
    return (p.world_size - 1) * p.mean_rows * (p.index_bytes + p.row_bytes)


def bytes_range_parallel(p: Profile) -> float:
    """Even ranges, COO both ways (sparse_ps), if perfectly balanced: a lower bound, since skew
    only adds to its busiest link."""
    n = p.world_size
    if n == 1:
        return 0.0
    return (n - 1) / n * (p.mean_rows + p.union_rows) * (p.index_bytes + p.row_bytes)
