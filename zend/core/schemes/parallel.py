"""Parallel aggregation: push each partition to its owner, sum there once, pull from every owner.

One skeleton, three schemes that differ only in how they partition and encode:
- `zen`: ZEN's Balanced Parallelism: hash partition, each message takes the cheaper of COO and
  the hash bitmap;
- `sparse_ps`: even row ranges, COO both ways (a classic sparse parameter server);
- `omnireduce`: even ranges of 256-element blocks, non-zero blocks only, COO of blocks.
"""

from __future__ import annotations

import torch

from zend.core.aggregate import sum_keyed
from zend.core.codec import Encoding, decode_units, encode_units, read_header
from zend.core.comm import Channel
from zend.core.partition import (
    BlockRangePartitioner,
    Part,
    Partitioner,
    RowRangePartitioner,
    ZenPartitioner,
)
from zend.core.schemes.base import ExchangeScheme, SyncResult, finish, imbalance
from zend.core.sparse import SparseGrad

BOTH = (Encoding.COO, Encoding.BITMAP)
COO_ONLY = (Encoding.COO,)


class ParallelScheme(ExchangeScheme):
    encodings: tuple[Encoding, ...] = BOTH

    def partitioner(self, grad: SparseGrad, world_size: int) -> Partitioner:
        raise NotImplementedError

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool) -> SyncResult:
        n = ch.world_size
        parts = self.partitioner(grad, n)
        split = parts.split(grad)
        self._push(ch, parts, split)
        mine, units_in = self._aggregate(ch, parts, split, grad.dtype, average, deterministic)
        pulled, units_at_owner = self._pull(ch, parts, mine, units_in, grad.dtype)
        units_per_row = self.units_per_row(parts)
        return SyncResult(
            parts.assemble(pulled, grad),
            self.name,
            ch.traffic,
            push_imbalance=imbalance([p.count for p in split]),
            push_load_imbalance=imbalance(units_at_owner),
            pull_imbalance=imbalance([p.count for p in pulled]),
            mean_input_rows=sum(units_at_owner) / n / units_per_row if units_per_row else None,
            details={"unit_width": parts.unit_width},
        )

    def _push(self, ch: Channel, parts: Partitioner, split: list[Part]) -> None:
        """Partition j's units go to rank j."""
        n, me = ch.world_size, ch.rank
        for step in range(1, n):
            j = (me + step) % n  # staggered, so that no owner is everyone's first target
            msg = encode_units(split[j].keys, split[j].values, parts.domain_size(j), self.encodings)
            ch.note_encoding("push", read_header(msg).kind.name)
            ch.send(j, "push", msg)

    def _aggregate(self, ch: Channel, parts: Partitioner, split: list[Part], dtype: torch.dtype, average: bool,
                   deterministic: bool) -> tuple[Part, int]:
        """This rank's partition summed over every rank, and how many units it received."""
        n, me = ch.world_size, ch.rank
        received: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(n):  # rank order: the sum's order does not depend on arrival
            if i == me:
                received.append((split[me].keys, split[me].values))
            else:
                keys, values, _ = decode_units(ch.recv(i, "push"), parts.unit_width, parts.domain_size(me), dtype)
                received.append((keys, values))
        units_in = sum(k.numel() for k, _ in received)
        agg_keys, agg32 = sum_keyed(received, deterministic)
        return Part(agg_keys, finish(agg32, dtype, average, n)), units_in

    def _pull(self, ch: Channel, parts: Partitioner, mine: Part, units_in: int, dtype: torch.dtype
              ) -> tuple[list[Part], list[int]]:
        """Every owner sends its summed partition to every other rank; returns every partition and the
        units each owner received (riding in the header: the cluster-wide figures auto learns from)."""
        n, me = ch.world_size, ch.rank
        msg = encode_units(mine.keys, mine.values, parts.domain_size(me), self.encodings,
                           aux=units_in, keys_sorted=True)
        ch.note_encoding("pull", read_header(msg).kind.name)
        for step in range(1, n):
            ch.send((me + step) % n, "pull", msg)
        pulled: list[Part] = []
        units_at_owner: list[int] = []
        for j in range(n):
            if j == me:
                pulled.append(mine)
                units_at_owner.append(units_in)
            else:
                keys, values, header = decode_units(ch.recv(j, "pull"), parts.unit_width, parts.domain_size(j),
                                                    dtype)
                pulled.append(Part(keys, values))
                units_at_owner.append(header.aux)
        return pulled, units_at_owner

    def units_per_row(self, parts: Partitioner) -> float | None:
        return None


class ZenScheme(ParallelScheme):
    """ZEN's Balanced Parallelism (hash partition, incremental aggregation at the owner)."""

    name = "zen"

    def __init__(self, seed: int = 0, min_slice_width: int = 8):
        self.seed = seed
        self.min_slice_width = min_slice_width

    def partitioner(self, grad: SparseGrad, world_size: int) -> ZenPartitioner:
        return ZenPartitioner(grad.num_rows, grad.row_len, world_size, self.seed, self.min_slice_width)

    def units_per_row(self, parts: Partitioner) -> float:
        assert isinstance(parts, ZenPartitioner)
        return float(parts.slices)


class SparsePSScheme(ParallelScheme):
    """Even row ranges, COO push and pull."""

    name = "sparse_ps"
    encodings = COO_ONLY

    def partitioner(self, grad: SparseGrad, world_size: int) -> RowRangePartitioner:
        return RowRangePartitioner(grad.num_rows, grad.row_len, world_size)

    def units_per_row(self, parts: Partitioner) -> float:
        return 1.0


class OmniReduceScheme(ParallelScheme):
    """Even ranges of 256-element blocks; non-zero blocks only; one-shot sum at the owner."""

    name = "omnireduce"
    encodings = COO_ONLY

    def __init__(self, block: int = 256):
        self.block = block

    def partitioner(self, grad: SparseGrad, world_size: int) -> BlockRangePartitioner:
        return BlockRangePartitioner(grad.num_rows, grad.row_len, world_size, self.block)
