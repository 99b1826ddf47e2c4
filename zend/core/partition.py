"""Partitioners: who aggregates which part of a sparse gradient.

A partitioner cuts a tensor into *units* of equal width (`unit_width` values) and gives every
unit to one of `num_parts` partitions. Partition j's units are numbered 0..domain_size(j)-1 in
a fixed order known to every rank (its *domain*), so a set of units of partition j is a set of
integer *keys*: sent as a list (COO) or as a bitmap over the domain.

- `ZenPartitioner`: ZEN's balanced parallelism. Hash-based, data-independent, lossless.
- `RowRangePartitioner`: even row ranges (a classic sparse parameter server).
- `BlockRangePartitioner`: even ranges of 256-element blocks (OmniReduce).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from zend.core import kernels
from zend.core.hashing import SeededHash
from zend.core.sparse import ResultPlace, SparseGrad


@dataclass(frozen=True)
class Part:
    """Units of one partition: `keys` (int32 or int64, unique) and their values, `source[rows]`.

    `rows` None means all of `source`. Keeping the gather lazy lets the encoder write the values
    straight into the message (one copy, not two).
    """

    keys: torch.Tensor
    source: torch.Tensor  # (units, unit_width)
    rows: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return int(self.keys.numel())

    @property
    def values(self) -> torch.Tensor:
        """(count, unit_width), in key order."""
        return self.source if self.rows is None else self.source.index_select(0, self.rows)


class Partitioner(ABC):
    num_parts: int
    unit_width: int

    @abstractmethod
    def domain_size(self, part: int) -> int:
        """Number of units partition `part` can hold (keys lie in [0, domain_size))."""

    @abstractmethod
    def split(self, grad: SparseGrad) -> list[Part]:
        """Cut a coalesced gradient into one Part per partition (lossless)."""

    @abstractmethod
    def assemble(self, parts: Sequence[Part], template: SparseGrad, place: ResultPlace | None = None) -> SparseGrad:
        """Inverse of split: parts[j] holds units of partition j; returns a coalesced gradient, in
        `place`'s room where the partitioner can assemble there (else in memory of its own)."""

    def check_keys(self, part: int, keys: torch.Tensor) -> None:
        """ValueError unless every key of partition `part` (each already in its domain) is a unit of
        the tensor: what a received message is checked against. A domain that is exactly the
        partition's units has nothing more to check."""
        return None


# Assembling through a table over all rows (two linear passes) beats sorting the pulled rows
# while there are at most this many rows per pulled unit.
_MARK_ROWS_PER_UNIT = 32
_BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integers: kernels copy bits


def _floordiv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n & (n - 1) == 0:
        return torch.bitwise_right_shift(x, n.bit_length() - 1)
    return torch.div(x, n, rounding_mode="floor")


def _mod_small(x: torch.Tensor, n: int) -> torch.Tensor:
    """x mod n for 0 <= x < 2n."""
    if n & (n - 1) == 0:
        return x.bitwise_and_(n - 1)
    return torch.where(x >= n, x - n, x)




def _group_by_part(part_ids: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, list[int]]:
    """A stable order that groups elements by partition, and the group sizes.

    On CPU numpy's stable argsort is a radix sort for 8/16-bit keys: 3-4x torch.sort.
    """
    if part_ids.is_cuda:
        order = torch.sort(part_ids, stable=True).indices
        return order, torch.bincount(part_ids, minlength=num_parts).tolist()
    small = part_ids.numpy().astype(np.uint8 if num_parts <= 256 else np.uint16)
    order = torch.from_numpy(np.argsort(small, kind="stable").astype(np.int64, copy=False))
    return order, np.bincount(small, minlength=num_parts).tolist()


@lru_cache(maxsize=1024)
def _keys_past_the_rows(num_rows: int, n: int, s_count: int, multiplier: int, salt: int, part: int
                        ) -> tuple[int, ...]:
    """The keys of ZEN partition `part`'s last block that decode to rows past the tensor, ascending
    (ZenPartitioner.rows_of for the last block, in integers: kernels._zen_rows_of's formula)."""
    if num_rows % n == 0:
        return ()
    b = math.ceil(num_rows / n) - 1
    h = ((((b ^ salt) * multiplier) & 0xFFFFFFFF) * n) >> 32  # zend.core.hashing.SeededHash
    return tuple(b * s_count + s for s in range(s_count) if b * n + (part + 2 * n - s - h) % n >= num_rows)


def _largest_divisor_at_most(value: int, limit: int) -> int:
    for d in range(max(1, min(value, limit)), 0, -1):
        if value % d == 0:
            return d
    return 1


class ZenPartitioner(Partitioner):
    """ZEN's hash partition, made balanced for wide rows and free of domain metadata.

    Rows are grouped in blocks of n consecutive rows; within block b, row r is *rotated* to
    rot(r) = (h(b) + r mod n) mod n, where h is the seeded hash. A row of `row_len` values is
    cut into S equal slices (S divides row_len, S <= n, each at least `min_slice_width` wide)
    and slice s of row r goes to partition (rot(r) + s) mod n.

    - Balance: wide rows (S = n) spread evenly over all partitions whatever the skew; narrow
      rows and element-sparse tensors (S = 1) are hashed, and the rotation gives consecutive,
      similarly hot rows distinct partitions.
    - Domain: in each block, partition j receives exactly one row per slice index, so its
      domain is ordered by (block, slice) and a unit's key is b * S + s. Membership and order
      are computed on the fly: zero bytes of metadata, whatever the tensor's size.
    - Every (row, slice) has exactly one owner: lossless by construction.
    """

    def __init__(self, num_rows: int, row_len: int, num_parts: int, seed: int, min_slice_width: int = 8):
        self.num_rows = num_rows
        self.row_len = row_len
        self.num_parts = num_parts
        self.hash = SeededHash(seed, num_parts)
        self.slices = _largest_divisor_at_most(row_len, min(num_parts, max(1, row_len // max(1, min_slice_width))))
        self.unit_width = row_len // self.slices
        self.num_blocks = math.ceil(num_rows / num_parts)

    def domain_size(self, part: int) -> int:
        return self.num_blocks * self.slices

    def rotation(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rot(r), block of r) for int64 rows; rot(r) is the partition of slice 0 of row r."""
        n = self.num_parts
        blocks = _floordiv(rows, n)
        if n & (n - 1) == 0:  # (h(b) + r mod n) mod n = (h(b) + r) mod n: two ops fewer
            return self.hash(blocks).add_(rows).bitwise_and_(n - 1), blocks
        return _mod_small(self.hash(blocks).add_(rows - blocks * n), n), blocks

    def split(self, grad: SparseGrad) -> list[Part]:
        """The compiled grouping (kernels.zen_split) where it applies, else its torch twin."""
        rows = grad.indices.to(torch.int64)
        units = grad.flat_values().reshape(-1, self.unit_width)  # unit u = row u // S, slice u % S
        if not self._every_slice_everywhere() and kernels.serves(rows):
            return self._split_compiled(rows, units)
        return self._split_torch(rows, units)

    def _every_slice_everywhere(self) -> bool:
        """S = n > 1: each partition takes one slice of every row, a strided pick with nothing to group."""
        return self.slices == self.num_parts and self.num_parts > 1

    def _split_compiled(self, rows: torch.Tensor, units: torch.Tensor) -> list[Part]:
        order_np, keys_np, counts_np = kernels.zen_split(rows.numpy(), self.num_parts, self.slices,
                                                         self.hash.multiplier, self.hash.salt)
        order, keys, counts = torch.from_numpy(order_np), torch.from_numpy(keys_np), counts_np.tolist()
        return [Part(k, units, o) for k, o in zip(keys.split(counts), order.split(counts), strict=True)]

    def _split_torch(self, rows: torch.Tensor, units: torch.Tensor) -> list[Part]:
        n, s_count = self.num_parts, self.slices
        rot, blocks = self.rotation(rows)
        if self._every_slice_everywhere():
            # every row gives each partition exactly one slice, s = (j - rot(r)) mod n: no sort,
            # partition j's units are a strided pick from the rows, in row order
            slice_of = _mod_small(torch.arange(n, device=rows.device).unsqueeze(1) + (n - rot), n)  # (n, nnz)
            unit_rows = slice_of + (torch.arange(rows.numel(), device=rows.device) * s_count)
            keys = (slice_of + blocks * s_count).to(torch.int32)  # keys < 2^31: half the bytes to move
            return [Part(keys[j], units, unit_rows[j]) for j in range(n)]
        if s_count == 1:
            part_ids, keys = rot, blocks.to(torch.int32)
        else:
            slice_ids = torch.arange(s_count, device=rows.device)
            part_ids = _mod_small(rot.unsqueeze(1) + slice_ids, n).reshape(-1)
            keys = (blocks.unsqueeze(1) * s_count + slice_ids).reshape(-1).to(torch.int32)
        order, counts = _group_by_part(part_ids, n)
        keys = keys.index_select(0, order)
        return [Part(k, units, o) for k, o in zip(keys.split(counts), order.split(counts), strict=True)]

    def rows_of(self, part: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode keys of partition `part` into (rows, slice indices)."""
        n, s_count = self.num_parts, self.slices
        keys = keys.to(torch.int64)  # b * n below may pass 2^31
        blocks = torch.div(keys, s_count, rounding_mode="floor") if s_count > 1 else keys
        slice_ids = keys - blocks * s_count
        # r mod n = (part - s - h(b)) mod n, each term in [0, n): shift by 2n to stay positive.
        offset = (part + 2 * n - slice_ids - self.hash(blocks)) % n
        return blocks * n + offset, slice_ids

    def check_keys(self, part: int, keys: torch.Tensor) -> None:
        """The domain holds every block whole, but the last block is partial when n does not divide
        num_rows: some of its keys decode to rows past the tensor. Those keys (S at most, the same at
        every step) are known in advance: one max over the keys, a comparison only if it reaches them."""
        past = _keys_past_the_rows(self.num_rows, self.num_parts, self.slices, self.hash.multiplier, self.hash.salt,
                                   part)
        if not past or keys.numel() == 0 or int(keys.max()) < past[0]:
            return
        wrong = set(keys[keys >= past[0]].tolist()).intersection(past)  # the few keys at the domain's top
        if wrong:
            key = min(wrong)
            row = int(self.rows_of(part, torch.tensor([key]))[0][0])
            raise ValueError(f"key {key} decodes to row {row}, outside partition {part}'s rows "
                             f"(num_rows {self.num_rows}: the last block is partial)")

    def assemble(self, parts: Sequence[Part], template: SparseGrad, place: ResultPlace | None = None) -> SparseGrad:
        """Every row of the union, each of its S slices from the partition that owns it.

        The caller promises each part's keys are unique (decode checks it); that every union row
        gets all S slices (each row that any rank had went to every slice's owner) is checked by
        counting, so the output, allocated uninitialised, has every element written.
        """
        total = sum(p.count for p in parts)
        marking = self.num_rows <= _MARK_ROWS_PER_UNIT * max(total, 1)
        # whole-row units of a sparse union: merge the partitions' ascending rows, no table over all rows
        merge = self.slices == 1 and len(parts) <= kernels.MAX_MERGE_RUNS and self.num_rows > 2 * total
        if (marking or merge) and kernels.serves(template.values) and parts:
            return self._assemble_compiled(parts, template, merge, place)
        return self._assemble_torch(parts, template, marking)

    def _assemble_torch(self, parts: Sequence[Part], template: SparseGrad, marking: bool) -> SparseGrad:
        dtype, device = template.dtype, template.device
        total = sum(p.count for p in parts)
        s_count, width = self.slices, self.unit_width
        decoded = [self.rows_of(j, p.keys) for j, p in enumerate(parts)]
        for j, (r, _) in enumerate(decoded):
            if r.numel() and int(r.max()) >= self.num_rows:
                key = int(parts[j].keys[int(r.argmax())])
                raise ValueError(f"partition {j}: key {key} decodes outside the tensor's {self.num_rows} rows")
        values = [p.values for p in parts]
        if s_count == 1 and not marking:
            # element-sparse and sparse: rows of distinct partitions never repeat, each part's are
            # ascending, so a stable merge of the runs (numpy's timsort) orders them
            rows = torch.cat([r for r, _ in decoded])
            order = torch.from_numpy(np.argsort(rows.cpu().numpy(), kind="stable")).to(device)
            out = torch.empty(total, width, dtype=dtype, device=device)
            torch.index_select(torch.cat(values), 0, order, out=out)
            return self._result(rows.index_select(0, order), out, template)
        if marking:
            present = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
            for r, _ in decoded:
                present.index_fill_(0, r, 1)
            position = present.cumsum(0, dtype=torch.int32) - 1
            union = present.nonzero().squeeze(1)
            where = [position.index_select(0, r).long() * s_count + s for r, s in decoded]
        else:
            union, inverse = torch.unique(torch.cat([r for r, _ in decoded]), sorted=True, return_inverse=True)
            where = list((inverse * s_count + torch.cat([s for _, s in decoded])).split([p.count for p in parts]))
        if total != union.numel() * s_count:
            raise ValueError(f"tensor {template.name!r}: {total} units pulled for {union.numel()} rows of "
                             f"{s_count} slices: a slice is missing or repeated")
        # a gather is 2-3x faster than a scatter on CPU: invert the destinations, then gather
        source_of = torch.empty(total, dtype=torch.int64, device=device)
        source_of.index_copy_(0, torch.cat(where), torch.arange(total, device=device))
        out = torch.empty(total, width, dtype=dtype, device=device)
        torch.index_select(torch.cat(values), 0, source_of, out=out)
        return self._result(union, out, template)

    def _assemble_compiled(self, parts: Sequence[Part], template: SparseGrad, merge: bool,
                           place: ResultPlace | None) -> SparseGrad:
        bits = _BITS_OF[template.values.element_size()]
        given: list[tuple[torch.Tensor, torch.Tensor]] = []

        def room(rows: int) -> tuple[np.ndarray, np.ndarray] | None:
            """`place`'s room as the kernel writes it (rows, units as integer bits), if it fits the result."""
            got = place(rows) if place is not None else None
            if got is None:
                return None
            indices, values = got
            if (indices.dtype != torch.int64 or indices.shape != (rows,) or values.dtype != template.dtype
                    or values.shape != (rows, *template.row_shape) or values.device.type != "cpu"
                    or not values.is_contiguous()):
                return None
            given.append(got)
            return indices.numpy(), values.view(bits).reshape(rows * self.slices, self.unit_width).numpy()

        union, out = kernels.zen_assemble(
            [p.keys.numpy() for p in parts], [p.values.view(bits).numpy() for p in parts], self.num_rows,
            self.num_parts, self.slices, self.hash.multiplier, self.hash.salt, merge, room)
        if given:
            indices, values = given[0]
            return SparseGrad(indices, values, template.num_rows, template.name, True)
        return self._result(torch.from_numpy(union), torch.from_numpy(out).view(template.dtype), template)

    @staticmethod
    def _result(rows: torch.Tensor, units: torch.Tensor, template: SparseGrad) -> SparseGrad:
        return SparseGrad(rows, units.reshape(rows.numel(), *template.row_shape), template.num_rows, template.name,
                          True)


class _RangePartitioner(Partitioner):
    """Even ranges of units: partition j owns units [bounds[j], bounds[j+1])."""

    def __init__(self, num_units: int, num_parts: int):
        self.num_parts = num_parts
        self.bounds = [j * num_units // num_parts for j in range(num_parts + 1)]

    def domain_size(self, part: int) -> int:
        return self.bounds[part + 1] - self.bounds[part]

    def _split_sorted(self, unit_ids: torch.Tensor, units: torch.Tensor) -> list[Part]:
        cuts = torch.searchsorted(unit_ids, torch.tensor(self.bounds, device=unit_ids.device)).tolist()
        return [
            Part(unit_ids[cuts[j] : cuts[j + 1]] - self.bounds[j], units[cuts[j] : cuts[j + 1]])
            for j in range(self.num_parts)
        ]

    def _global_ids(self, parts: Sequence[Part]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([p.keys + self.bounds[j] for j, p in enumerate(parts)])
        return ids, torch.cat([p.values for p in parts])


class RowRangePartitioner(_RangePartitioner):
    """Units are whole rows; partition j owns an even range of rows."""

    def __init__(self, num_rows: int, row_len: int, num_parts: int):
        super().__init__(num_rows, num_parts)
        self.unit_width = row_len

    def split(self, grad: SparseGrad) -> list[Part]:
        return self._split_sorted(grad.indices.to(torch.int64), grad.flat_values())

    def assemble(self, parts: Sequence[Part], template: SparseGrad, place: ResultPlace | None = None) -> SparseGrad:
        rows, values = self._global_ids(parts)  # ranges are disjoint and ordered: already sorted
        return SparseGrad(rows, values.reshape(-1, *template.row_shape), template.num_rows, template.name, True)


class BlockRangePartitioner(_RangePartitioner):
    """OmniReduce: the flattened tensor in blocks of `block` elements; even ranges of blocks.

    A block goes on the wire whole (with its zeros) as soon as one of its elements belongs to
    a non-zero row, as OmniReduce does.
    """

    def __init__(self, num_rows: int, row_len: int, num_parts: int, block: int = 256):
        self.total = num_rows * row_len
        super().__init__(math.ceil(self.total / block), num_parts)
        self.unit_width = block
        self.row_len = row_len

    def _row_block_spans(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First and last block that each row's elements fall in."""
        return (_floordiv(rows * self.row_len, self.unit_width),
                _floordiv((rows + 1) * self.row_len - 1, self.unit_width))

    def _padded(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.bounds[-1] * self.unit_width, dtype=dtype, device=device)

    def split(self, grad: SparseGrad) -> list[Part]:
        # Through a dense scratch copy of the tensor: simpler and, on the simulator's sizes,
        # faster than sorting element ids (this is the baseline, not the hot path).
        rows = grad.indices.to(torch.int64)
        flat = self._padded(grad.dtype, grad.device)
        flat[: self.total].view(-1, self.row_len)[rows] = grad.flat_values()
        first, last = self._row_block_spans(rows)
        touched = torch.zeros(self.bounds[-1] + 1, dtype=torch.int64, device=rows.device)
        touched.index_add_(0, first, torch.ones_like(first))
        touched.index_add_(0, last + 1, -torch.ones_like(last))
        block_ids = (touched.cumsum(0)[:-1] > 0).nonzero().squeeze(1)
        return self._split_sorted(block_ids, flat.view(-1, self.unit_width)[block_ids])

    def assemble(self, parts: Sequence[Part], template: SparseGrad, place: ResultPlace | None = None) -> SparseGrad:
        block_ids, blocks = self._global_ids(parts)
        flat = self._padded(blocks.dtype, blocks.device)
        flat.view(-1, self.unit_width)[block_ids] = blocks
        present = torch.zeros(self.bounds[-1] + 1, dtype=torch.int64, device=blocks.device)
        present[block_ids + 1] = 1
        seen = present.cumsum(0)  # seen[b + 1] - seen[a] = blocks present among a..b
        first, last = self._row_block_spans(torch.arange(template.num_rows, device=blocks.device))
        rows = ((seen[last + 1] - seen[first]) > 0).nonzero().squeeze(1)
        values = flat[: self.total].view(-1, self.row_len)[rows]
        return SparseGrad(rows, values.reshape(-1, *template.row_shape), template.num_rows, template.name, True)
