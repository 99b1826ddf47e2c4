"""One fused step's tensor (tensor fusion, `Client.allreduce_many`): the tables of a `fusion.Batch`
stacked into one row-sparse tensor, and the step's result split back into each table's rows.

Table i's rows follow table i-1's (offsets). Where the batch's rows are narrower than a table's, each
of its rows is cut into consecutive rows of the batch's width (row r of a table cut in k: rows
r*k .. r*k + k-1 after its offset), and joined again on the way back. Every trainer stacks alike
(the same tables, names and shapes, in the same order), so the fused tensor and its name are the
same on every trainer. torch only, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zen.fusion import Batch, Table


@dataclass(frozen=True)
class Packed:
    name: str  # "fused:<digest of the members' names and shapes>": the daemon's tensor
    indices: torch.Tensor  # rows of the fused tensor (int64), in each table's own order
    values: torch.Tensor  # (rows given, *row shape): the tables' rows as they are, or cut to the batch's width
    num_rows: int
    offsets: tuple[int, ...]  # table j's rows start at offsets[j]; offsets[-1] == num_rows
    cuts: tuple[int, ...]  # table j's rows are cut into cuts[j] rows each


def table_of(t: torch.Tensor) -> Table:
    """What fusion plans a row-sparse tensor by: its kind (dtype, device), row size, item size and rows."""
    return Table((t.dtype, t.device), math.prod(t.shape[1:]), t.element_size(), t.shape[0])


def pack(tensors: Sequence[torch.Tensor], names: Sequence[str], batch: Batch) -> Packed:
    """The batch's members of `tensors` (row-sparse COO, sparse_dim 1), stacked into one tensor."""
    parts = [tensors[i] for i in batch.members]
    cuts = tuple(math.prod(t.shape[1:]) // batch.width if batch.width else 1 for t in parts)
    offsets = [0]
    for t, cut in zip(parts, cuts, strict=True):
        offsets.append(offsets[-1] + t.shape[0] * cut)
    indices = torch.cat([_cut_rows(t._indices()[0], cut) + off
                         for t, cut, off in zip(parts, cuts, offsets, strict=False)])
    one_shape = len({tuple(t.shape[1:]) for t in parts}) == 1  # rows stacked as they are
    values = torch.cat([t._values() if one_shape else t._values().reshape(t._nnz() * cut, batch.width)
                        for t, cut in zip(parts, cuts, strict=True)])
    key = "\0".join(f"{names[i]}:{list(tensors[i].shape)}" for i in batch.members)
    return Packed(f"fused:{hashlib.sha1(key.encode()).hexdigest()[:16]}", indices, values, offsets[-1],
                  tuple(offsets), cuts)


def unpack(packed: Packed, rows: torch.Tensor, values: torch.Tensor,
           row_shapes: Sequence[tuple[int, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fused step's result (rows ascending, as every scheme gives them) as each member's (rows,
    values of `row_shapes[j]`), in the batch's order. Rows are not range-checked here: the caller
    checks them against each table before it builds a tensor from them."""
    bounds = torch.searchsorted(rows, torch.tensor(packed.offsets, device=rows.device)).tolist()
    out = []
    for j, (cut, shape) in enumerate(zip(packed.cuts, row_shapes, strict=True)):
        lo, hi = bounds[j], bounds[j + 1]
        out.append(_joined_rows(rows[lo:hi] - packed.offsets[j], values[lo:hi], cut, shape))
    return out


def _cut_rows(rows: torch.Tensor, cut: int) -> torch.Tensor:
    """Row r of a table cut into `cut` rows each: rows r*cut .. r*cut + cut-1, in order."""
    if cut == 1:
        return rows
    return (rows.unsqueeze(1) * cut + torch.arange(cut, device=rows.device)).reshape(-1)


def _joined_rows(rows: torch.Tensor, values: torch.Tensor, cut: int,
                 row_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_cut_rows` undone on a result: its (ascending) cut rows back into whole rows of `row_shape`. A
    row's pieces all come back together (every trainer sent them all); one missing would be zeros."""
    if cut == 1:
        return rows, values.reshape(values.shape[0], *row_shape)
    whole, at = torch.unique_consecutive(torch.div(rows, cut, rounding_mode="floor"), return_inverse=True)
    joined = values.new_zeros((whole.numel(), cut, values.shape[-1]))
    joined[at, rows % cut] = values
    return whole, joined.reshape(-1, *row_shape)
