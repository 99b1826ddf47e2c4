"""Every rank's bytes for every scheme, counted from the ranks' row sets instead of exchanged.

Running n ranks in one process costs O(n^2) messages and n copies of every gradient; at
n = 1,024 that takes hours. But a scheme's traffic depends only on *how many* units each
message carries, not on their values: the size of every message follows from the
partitioner's counts and the codec's exact sizes (`codec.encoded_size`, the cheaper encoding
where a scheme may choose). So this module computes, for each scheme, every message's size
from the same partitioners and the same encoding rule the schemes use, and sums them per rank.
The figures equal the exchanged run's byte for byte (tests/test_simulate_cli.py checks it, the
note of issue 12 at n = 128); imbalances are computed from the same counts.

Each scheme's model is found through its class (TRAFFIC_MODELS, keyed by the classes of the
registry zend.core.schemes.SCHEMES): every model takes one step's rows (`Step`) and returns every
rank's bytes. A registered scheme without a model fails tests/test_simulate_cli.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from zend.core import costmodel
from zend.core.codec import Encoding, encoded_size
from zend.core.partition import BlockRangePartitioner, RowRangePartitioner, ZenPartitioner
from zend.core.schemes import SCHEMES, Scheme
from zend.core.schemes.auto import PROFILER, AutoScheme, choose_by_bytes
from zend.core.schemes.centralized import AGSparseScheme, HCScheme
from zend.core.schemes.dense import DenseScheme
from zend.core.schemes.parallel import BOTH, COO_ONLY, OmniReduceScheme, SparsePSScheme, ZenScheme
from zend.core.sparse import SparseGrad


@dataclass
class Traffic:
    """Bytes every rank sent and received for one step of one scheme, and the imbalances."""

    sent: np.ndarray  # (n,) int64
    recv: np.ndarray
    scheme: str  # what ran ("auto:zen" for auto)
    push_imbalance: float = 1.0
    push_load_imbalance: float = 1.0
    pull_imbalance: float = 1.0


@dataclass
class Step:
    """What a traffic model counts from: every rank's non-zero rows of one tensor in one step."""

    row_sets: Sequence[np.ndarray]
    num_rows: int
    row_len: int
    dtype: torch.dtype
    seed: int
    auto_choice: str | None = None  # what auto runs after profiling (None: it profiles)

    @property
    def n(self) -> int:
        return len(self.row_sets)

    @cached_property
    def union(self) -> np.ndarray:
        """The rows of the sum."""
        return np.unique(np.concatenate(self.row_sets)) if self.row_sets else np.empty(0, dtype=np.int64)


Model = Callable[[Step], Traffic]


def _size(count: int, width: int, domain: int, dtype: torch.dtype, allowed: tuple[Encoding, ...]) -> int:
    """The message size the scheme would send: the cheaper allowed encoding (codec.cheapest)."""
    return min(encoded_size(k, count, width, domain, dtype) for k in allowed)


def _imbalance(counts: np.ndarray) -> float:
    total = int(counts.sum())
    return float(len(counts) * counts.max() / total) if total else 1.0


def _parallel(counts: np.ndarray, owned: np.ndarray, width: int, domains: Sequence[int], dtype: torch.dtype,
              allowed: tuple[Encoding, ...], name: str) -> Traffic:
    """Push / pull: counts[i, j] units of rank i for owner j; owned[j] units owner j summed."""
    n = counts.shape[0]
    push = np.array([[_size(int(counts[i, j]), width, domains[j], dtype, allowed) for j in range(n)]
                     for i in range(n)], dtype=np.int64)
    np.fill_diagonal(push, 0)
    pull = np.array([_size(int(owned[j]), width, domains[j], dtype, allowed) for j in range(n)], dtype=np.int64)
    sent = push.sum(axis=1) + (n - 1) * pull
    recv = push.sum(axis=0) + (pull.sum() - pull)
    pushed = max(_imbalance(counts[i]) for i in range(n))
    return Traffic(sent, recv, name, pushed, _imbalance(counts.sum(axis=0)), _imbalance(owned))


def _zen_counts(parts: ZenPartitioner, rows: np.ndarray) -> np.ndarray:
    grad = SparseGrad(torch.from_numpy(rows), torch.empty(len(rows), parts.row_len), parts.num_rows, "m", True)
    return np.array([p.count for p in parts.split(grad)], dtype=np.int64)


def _range_counts(parts: RowRangePartitioner | BlockRangePartitioner, unit_ids: np.ndarray) -> np.ndarray:
    return np.diff(np.searchsorted(unit_ids, np.array(parts.bounds)))


def _touched_blocks(parts: BlockRangePartitioner, rows: np.ndarray) -> np.ndarray:
    """Blocks holding any element of the rows (BlockRangePartitioner.split, without the values)."""
    first, last = (t.numpy() for t in parts._row_block_spans(torch.from_numpy(rows)))
    touched = np.zeros(parts.bounds[-1] + 1, dtype=np.int64)
    np.add.at(touched, first, 1)
    np.add.at(touched, last + 1, -1)
    return np.flatnonzero(np.cumsum(touched)[:-1] > 0)


def zen_traffic(step: Step, min_slice_width: int = 8) -> Traffic:
    n = step.n
    parts = ZenPartitioner(step.num_rows, step.row_len, n, step.seed, min_slice_width)
    counts = np.stack([_zen_counts(parts, r) for r in step.row_sets])
    owned = _zen_counts(parts, step.union)
    return _parallel(counts, owned, parts.unit_width, [parts.domain_size(j) for j in range(n)], step.dtype, BOTH,
                     ZenScheme.name)


def sparse_ps_traffic(step: Step) -> Traffic:
    n = step.n
    parts = RowRangePartitioner(step.num_rows, step.row_len, n)
    counts = np.stack([_range_counts(parts, r) for r in step.row_sets])
    return _parallel(counts, _range_counts(parts, step.union), step.row_len, [parts.domain_size(j) for j in range(n)],
                     step.dtype, COO_ONLY, SparsePSScheme.name)


def omnireduce_traffic(step: Step, block: int = 256) -> Traffic:
    n = step.n
    parts = BlockRangePartitioner(step.num_rows, step.row_len, n, block)
    counts = np.stack([_range_counts(parts, _touched_blocks(parts, r)) for r in step.row_sets])
    owned = _range_counts(parts, _touched_blocks(parts, step.union))
    traffic = _parallel(counts, owned, block, [parts.domain_size(j) for j in range(n)], step.dtype, COO_ONLY,
                        OmniReduceScheme.name)
    rows = rows_traffic(n, step.num_rows)  # the ring that cuts the result to the rows sent
    traffic.sent += rows
    traffic.recv += np.roll(rows, 1)
    return traffic


def agsparse_traffic(step: Step) -> Traffic:
    """Ring allgather: rank r forwards every gradient but its successor's, receives all but its own."""
    own = np.array([_size(len(r), step.row_len, step.num_rows, step.dtype, COO_ONLY) for r in step.row_sets],
                   dtype=np.int64)
    total = own.sum()
    return Traffic(total - np.roll(own, -1), total - own, AGSparseScheme.name)


def hc_traffic(step: Step) -> Traffic:
    """Recursive doubling (the extra ranks of a non-power-of-two world fold into partners first)."""
    n, row_sets = step.n, step.row_sets
    sent, recv = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)

    def size(rows: np.ndarray) -> int:
        return _size(len(rows), step.row_len, step.num_rows, step.dtype, BOTH)

    power = 1 << (n.bit_length() - 1)
    extra = n - power
    held = [r for r in row_sets[:power]]
    for r in range(extra):  # fold: rank power + r sends its rows to rank r
        msg = size(row_sets[power + r])
        sent[power + r] += msg
        recv[r] += msg
        held[r] = np.union1d(held[r], row_sets[power + r])
    level = 1
    while level < power:
        sizes = [size(h) for h in held]
        nxt = list(held)
        for r in range(power):
            partner = r ^ level
            sent[r] += sizes[r]
            recv[r] += sizes[partner]
            nxt[r] = np.union1d(held[r], held[partner])
        held, level = nxt, level * 2
    for r in range(extra):  # unfold: the sum back to the extra rank
        msg = size(held[r])
        sent[r] += msg
        recv[power + r] += msg
    return Traffic(sent, recv, HCScheme.name)


def _ring_allreduce_sent(n: int, elements: int, item: int) -> np.ndarray:
    """Bytes each rank sends in a ring reduce-scatter + allgather of `elements` items in raw pieces:
    rank me sends chunk (me - s) in reduce-scatter step s and chunk (me + 1 - s) in allgather step s."""
    chunk = np.array([c.numel() for c in torch.tensor_split(torch.empty(elements, dtype=torch.uint8), n)])
    return np.array([sum(int(chunk[(me - s) % n]) + int(chunk[(me + 1 - s) % n]) for s in range(n - 1))
                     for me in range(n)], dtype=np.int64) * item


def rows_traffic(n: int, num_rows: int) -> np.ndarray:
    """The row bitmaps' ring OR (zend.core.schemes.rowset) of the schemes that densify: bytes sent per rank."""
    return _ring_allreduce_sent(n, (num_rows + 7) // 8, 1)


def dense_traffic(step: Step) -> Traffic:
    """The ring of raw pieces, and the row bitmaps' ring before it."""
    item = torch.empty(0, dtype=step.dtype).element_size()
    sent = _ring_allreduce_sent(step.n, step.num_rows * step.row_len, item) + rows_traffic(step.n, step.num_rows)
    return Traffic(sent, np.roll(sent, 1), DenseScheme.name)


def auto_traffic(step: Step) -> Traffic:
    """What auto runs: its profiler (zen), or what it chose after profiling (`step.auto_choice`)."""
    ran = step.auto_choice or PROFILER
    t = model_of(ran)(step)
    t.scheme = f"{AutoScheme.name}:{ran}"
    return t


TRAFFIC_MODELS: dict[type[Scheme], Model] = {
    ZenScheme: zen_traffic,
    HCScheme: hc_traffic,
    AGSparseScheme: agsparse_traffic,
    OmniReduceScheme: omnireduce_traffic,
    SparsePSScheme: sparse_ps_traffic,
    DenseScheme: dense_traffic,
    AutoScheme: auto_traffic,
}
MODELLED = tuple(name for name, cls in SCHEMES.items() if cls in TRAFFIC_MODELS)  # in the registry's order


def model_of(name: str) -> Model:
    """The traffic model of registered scheme `name`; ValueError if it has none."""
    scheme = SCHEMES.get(name)
    if scheme is None or scheme not in TRAFFIC_MODELS:
        raise ValueError(f"scheme {name!r} has no traffic model; modelled: {', '.join(MODELLED)}")
    return TRAFFIC_MODELS[scheme]


def step_traffic(name: str, row_sets: Sequence[np.ndarray], num_rows: int, row_len: int, dtype: torch.dtype,
                 seed: int, auto_choice: str | None = None) -> Traffic:
    """One step of scheme `name` (auto: what it runs, zen to profile unless `auto_choice` is given)."""
    return model_of(name)(Step(row_sets, num_rows, row_len, dtype, seed, auto_choice))


def auto_choice(row_sets: Sequence[np.ndarray], num_rows: int, row_len: int, dtype: torch.dtype) -> str:
    """What `auto` picks after profiling this step under deterministic=True (by bytes: zen, hc or
    dense), from the figures zen's pull gives it: mean rows per rank and the union's rows."""
    n = len(row_sets)
    union = np.unique(np.concatenate(row_sets))
    item = torch.empty(0, dtype=dtype).element_size()
    profile = costmodel.Profile(n, num_rows, row_len * item, sum(len(r) for r in row_sets) / n, float(len(union)))
    return choose_by_bytes(profile)
