"""Parallel aggregation: push each partition to its owner, sum there once, pull from every owner.

One skeleton, three schemes that differ only in how they partition and encode:
- `zen`: ZEN's Balanced Parallelism: hash partition, each message takes the cheaper of COO and
  the hash bitmap;
- `sparse_ps`: even row ranges, COO both ways (a classic sparse parameter server);
- `omnireduce`: even ranges of 256-element blocks, non-zero blocks only, COO of blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from zend.core import costmodel, kernels
from zend.core.aggregate import slot_keys, sum_into
from zend.core.codec import (
    Encoding,
    allocate_many,
    allocate_units,
    cheapest,
    encode_gathered,
    read_header,
    write_bitmap,
)
from zend.core.comm import Channel
from zend.core.partition import (
    BlockRangePartitioner,
    Part,
    Partitioner,
    RowRangePartitioner,
    ZenPartitioner,
)
from zend.core.schemes import rowset
from zend.core.schemes.base import (
    ExchangeScheme,
    ResultPlace,
    SyncResult,
    check_units,
    from_peer,
    imbalance,
)
from zend.core.sparse import SparseGrad

BOTH = (Encoding.COO, Encoding.BITMAP)
COO_ONLY = (Encoding.COO,)


def zen_push_messages(parts: ZenPartitioner, grad: SparseGrad, allowed: tuple[Encoding, ...], keep: int
                      ) -> tuple[list[torch.Tensor], Part, list[int]] | None:
    """Every partition's push message in two passes over a CPU gradient of whole-row units (S = 1):
    count the units per owner, then write each row's key and values straight into its owner's
    message (kernels.zen_scatter), with no grouping pass and no gather between. Partition `keep`
    (this rank's own) is made COO and not sent: its keys and values are read in place. Returns
    (messages, partition `keep`, units per partition), or None where the kernel does not apply
    (`_push_compiles`): the caller then splits and encodes each part, the torch twin."""
    if not _push_compiles(parts, grad):
        return None
    n, width, domain = parts.num_parts, parts.unit_width, parts.domain_size(0)
    rows = grad.indices.to(torch.int64).contiguous().numpy()
    counts = kernels.zen_counts(rows, n, parts.hash.multiplier, parts.hash.salt).tolist()
    kinds = [Encoding.COO if j == keep else cheapest(c, width, domain, grad.dtype, allowed)
             for j, c in enumerate(counts)]
    buffer, messages = allocate_many(kinds, counts, width, domain, grad.dtype)
    for m in messages:
        if m.kind is Encoding.BITMAP:
            m.index.zero_()
    bits = {2: torch.int16, 4: torch.int32}[grad.values.element_size()]
    units = grad.flat_values().contiguous().view(bits).numpy()
    kernels.zen_scatter(rows, units, n, parts.hash.multiplier, parts.hash.salt,
                        np.array([m.kind is Encoding.BITMAP for m in messages], dtype=np.bool_),
                        np.array([m.index.storage_offset() for m in messages], dtype=np.int64),  # in its own units
                        np.array([m.values.storage_offset() for m in messages], dtype=np.int64),
                        buffer.numpy())
    own = messages[keep]
    return [m.buf for m in messages], Part(own.index, own.values), counts


def _push_compiles(parts: ZenPartitioner, grad: SparseGrad) -> bool:
    """Whole-row units (S = 1) of a CPU gradient, n >= 2, rows and keys within the kernels' ranges."""
    return (parts.slices == 1 and parts.num_parts > 1 and kernels.serves(grad.values)
            and parts.num_rows < kernels.FAST_DIVISION_LIMIT and parts.domain_size(0) < 2**31)


class ParallelScheme(ExchangeScheme):
    encodings: tuple[Encoding, ...] = BOTH

    def partitioner(self, grad: SparseGrad, world_size: int) -> Partitioner:
        raise NotImplementedError

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        n = ch.world_size
        parts = self.partitioner(grad, n)
        push_message, own, push_counts = self.prepare_push(parts, grad, ch.rank)
        self._push(ch, push_message)
        mine, units_in, pull_msg = self._aggregate(ch, parts, own, grad.dtype, average, deterministic)
        pulled, units_at_owner = self._pull(ch, parts, mine, units_in, pull_msg)
        units_per_row = self.units_per_row(parts)
        return SyncResult(
            parts.assemble(pulled, grad, place),
            self.name,
            ch.traffic,
            push_imbalance=imbalance(push_counts),
            push_load_imbalance=imbalance(units_at_owner),
            pull_imbalance=imbalance([p.count for p in pulled]),
            mean_input_rows=sum(units_at_owner) / n / units_per_row if units_per_row else None,
            details={"unit_width": parts.unit_width},
        )

    def prepare_push(self, parts: Partitioner, grad: SparseGrad, me: int
                      ) -> tuple[Callable[[int], torch.Tensor], Part, list[int]]:
        """How partition j's push message is made, this rank's own partition, and every partition's
        unit count. ZEN's whole-row units on CPU take the two-pass kernel (every message made at
        once, no grouping pass between); otherwise each message is gathered from the split as it
        is sent, so that encoding the next overlaps the send of this one."""
        fused = zen_push_messages(parts, grad, self.encodings, me) if isinstance(parts, ZenPartitioner) else None
        if fused is not None:
            messages, own, counts = fused
            return messages.__getitem__, own, counts
        split = parts.split(grad)

        def encode(j: int) -> torch.Tensor:
            part = split[j]
            return encode_gathered(part.keys, part.source, part.rows, parts.domain_size(j), self.encodings)

        return encode, split[me], [p.count for p in split]

    def _push(self, ch: Channel, message: Callable[[int], torch.Tensor]) -> None:
        """Partition j's units go to rank j."""
        n, me = ch.world_size, ch.rank
        for step in range(1, n):
            j = (me + step) % n  # staggered, so that no owner is everyone's first target
            msg = message(j)
            ch.note_encoding("push", read_header(msg).kind.name)
            ch.send(j, "push", msg)

    def _aggregate(self, ch: Channel, parts: Partitioner, own: Part, dtype: torch.dtype, average: bool,
                   deterministic: bool) -> tuple[Part, int, torch.Tensor]:
        """This rank's partition summed over every rank, how many units it received, and the pull
        message that carries the sum (the sum is taken inside that message's buffer)."""
        n, me = ch.world_size, ch.rank
        domain = parts.domain_size(me)
        keys_in: list[torch.Tensor] = []
        values_in: list[torch.Tensor] = []
        others = [i for i in range(n) if i != me]
        pushed = dict(zip(others, ch.exchange("push", [], others), strict=True))  # the round, in one call
        for i in range(n):  # rank order: the sum's order does not depend on arrival
            if i == me:
                keys_in.append(own.keys)
                values_in.append(own.values)
            else:
                keys, values, _ = check_units(ch, i, "push", pushed.pop(i), parts.unit_width, domain, dtype,
                                              check_keys=partial(parts.check_keys, me))
                keys_in.append(keys)
                values_in.append(values)
        units_in = sum(k.numel() for k in keys_in)
        slots = slot_keys(keys_in, domain)
        kind = cheapest(slots.count, parts.unit_width, domain, dtype, self.encodings)
        msg = allocate_units(kind, slots.count, parts.unit_width, domain, dtype, values_in[0].device, aux=units_in)
        # fp32 sums in the message itself; narrower types in a float32 scratch, rounded once
        acc = msg.values if dtype == torch.float32 else torch.empty(msg.values.shape, dtype=torch.float32,
                                                                     device=msg.values.device)
        acc.zero_()
        sum_into(acc, slots, values_in, deterministic)
        if average and n > 1:
            acc.div_(n)
        if acc is not msg.values:
            msg.values.copy_(acc)
        if kind is Encoding.COO:
            msg.index.copy_(slots.keys)
        else:
            write_bitmap(msg.index, slots.keys, domain)
        return Part(slots.keys, msg.values), units_in, msg.buf

    def _pull(self, ch: Channel, parts: Partitioner, mine: Part, units_in: int, msg: torch.Tensor
              ) -> tuple[list[Part], list[int]]:
        """Every owner sends its summed partition to every other rank; returns every partition and the
        units each owner received (riding in the header: the cluster-wide figures auto learns from)."""
        n, me = ch.world_size, ch.rank
        ch.note_encoding("pull", read_header(msg).kind.name)
        # the round in one call: our sum to every rank (staggered), then every owner's sum
        got = ch.exchange("pull", [((me + step) % n, msg) for step in range(1, n)], [j for j in range(n) if j != me])
        from_owner = dict(zip([j for j in range(n) if j != me], got, strict=True))
        pulled: list[Part] = []
        units_at_owner: list[int] = []
        for j in range(n):
            if j == me:
                pulled.append(mine)
                units_at_owner.append(units_in)
            else:
                domain = parts.domain_size(j)
                keys, values, header = check_units(ch, j, "pull", from_owner.pop(j), parts.unit_width, domain,
                                                   mine.source.dtype, keys_ascending=True,
                                                   check_keys=partial(parts.check_keys, j))
                with from_peer(ch, j, "pull"):  # the units its owner received: at least its sum's, n x domain at most
                    if not header.count <= header.aux <= n * domain:
                        raise ValueError(f"it received {header.aux} units for a sum of {header.count} (domain "
                                         f"{domain}, {n} ranks)")
                pulled.append(Part(keys, values))
                units_at_owner.append(header.aux)
        return pulled, units_at_owner

    def units_per_row(self, parts: Partitioner) -> float | None:
        return None


class ZenScheme(ParallelScheme):
    """ZEN's Balanced Parallelism (hash partition, incremental aggregation at the owner)."""

    name = "zen"
    auto_candidate = True
    deterministic_candidate = True

    @staticmethod
    def bytes_per_rank(profile: costmodel.Profile) -> float:
        return costmodel.bytes_balanced_parallel(profile)

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
    auto_candidate = True

    @staticmethod
    def bytes_per_rank(profile: costmodel.Profile) -> float:
        return costmodel.bytes_range_parallel(profile)

    def partitioner(self, grad: SparseGrad, world_size: int) -> RowRangePartitioner:
        return RowRangePartitioner(grad.num_rows, grad.row_len, world_size)

    def units_per_row(self, parts: Partitioner) -> float:
        return 1.0


class OmniReduceScheme(ParallelScheme):
    """Even ranges of 256-element blocks; non-zero blocks only; one-shot sum at the owner. A block
    carries every row it overlaps, sent or not, so the result is cut to the rows some rank sent
    (`rowset`: their bitmaps OR-reduced around a ring)."""

    name = "omnireduce"  # no byte model (bytes_per_rank), so not one of auto's candidates
    encodings = COO_ONLY

    def __init__(self, block: int = 256):
        self.block = block

    def partitioner(self, grad: SparseGrad, world_size: int) -> BlockRangePartitioner:
        return BlockRangePartitioner(grad.num_rows, grad.row_len, world_size, self.block)

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        rows = rowset.union_rows(ch, grad)
        result = super().exchange(ch, grad, average=average, deterministic=deterministic, place=place)
        result.grad = rowset.restrict(result.grad, rows)
        return result
