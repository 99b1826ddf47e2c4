"""Row-sparse gradients: the one representation every scheme consumes and produces.

A gradient of a tensor with `num_rows` rows is `indices` (which rows are present, 1-D int32 or
int64) plus `values` (one row of `row_shape` per index). An element-sparse gradient is the
1-D case (`row_shape == ()`). Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from zend.core import dtypes

VALUE_DTYPES = dtypes.TORCH_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)
NonFinitePolicy = Literal["reject", "pass"]
# Where a scheme may write its result: given the result's row count, (indices (rows,) int64, values
# (rows, *row_shape)) to assemble into, or None (then it allocates). The daemon offers a trainer's
# shared result buffer this way, so that the sum is written once, where the trainer reads it.
ResultPlace = Callable[[int], "tuple[torch.Tensor, torch.Tensor] | None"]


class SparseGradError(ValueError):
    """A gradient that zen cannot synchronise; the message names the tensor and the value."""


def ascending(keys: torch.Tensor) -> bool:
    """Strictly ascending (so also unique): what sorted, coalesced indices and keys promise."""
    return keys.numel() < 2 or bool((keys[1:] > keys[:-1]).all())


def first_nonfinite(values: torch.Tensor) -> tuple[int, float] | None:
    """(row, value) of the first NaN or Inf of `values` (a row per leading index), or None.

    One cheap pass first: NaN and Inf propagate into the sum, so a finite sum means every value is
    finite; a non-finite one (a NaN, an Inf, or an overflow of the sum alone) sends us to the exact
    scan, which names the value or finds none."""
    if values.numel() == 0 or bool(torch.isfinite(values.sum())):
        return None
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    pos = int(bad.reshape(values.shape[0], -1).any(dim=1).nonzero()[0, 0])
    return pos, values[pos].reshape(-1)[bad[pos].reshape(-1)][0].item()


# Coalescing through a slot per row of the table (a counting sort: two passes over num_rows, none
# of them per value) beats a comparison sort (nnz log nnz) until the table is about 40 times the rows
# given, measured on CPU at 26k-1M rows; 16 keeps a margin. A recommender's small tables land here.
# CPU only: on a GPU index_add_ adds in no fixed order.
SLOT_COALESCE_ROWS_PER_INPUT = 16


def sum_by_slot(idx: torch.Tensor, vals: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending unique rows of `idx`, float32 sums of their `vals` rows), through a slot per row.

    index_add_ on CPU adds in the order given, so each row's duplicates are summed in their original
    order: the same bits as sum_by_sort's stable sort."""
    present = torch.zeros(num_rows, dtype=torch.bool, device=idx.device)
    present[idx] = True
    unique = present.nonzero().squeeze(1)
    slot = torch.empty(num_rows, dtype=torch.int64, device=idx.device)
    slot[unique] = torch.arange(unique.numel(), device=idx.device)
    summed = vals.new_zeros(unique.numel(), vals.shape[1], dtype=torch.float32)
    summed.index_add_(0, slot[idx], vals.to(torch.float32))
    return unique, summed


def sum_by_sort(idx: torch.Tensor, vals: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as sum_by_slot through a stable sort of `idx`: for tables too large for a slot per row,
    and on CUDA, where index_add_ adds in no fixed order and segment_reduce keeps it deterministic."""
    order = torch.sort(idx, stable=True).indices
    unique, counts = torch.unique_consecutive(idx[order], return_counts=True)
    vals = vals[order].to(torch.float32)
    if deterministic and vals.is_cuda:
        return unique, torch.segment_reduce(vals, "sum", lengths=counts, axis=0)
    summed = vals.new_zeros(unique.numel(), vals.shape[1])
    summed.index_add_(0, torch.repeat_interleave(counts), vals)  # i, counts[i] times; sequential on CPU
    return unique, summed


@dataclass(frozen=True)
class SparseGrad:
    """Rows `indices` of a (num_rows, *row_shape) tensor, with their `values`.

    `coalesced` promises that indices are sorted ascending and unique; schemes rely on it.
    """

    indices: torch.Tensor
    values: torch.Tensor
    num_rows: int
    name: str = "grad"
    coalesced: bool = False

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def row_len(self) -> int:
        return math.prod(self.row_shape)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return (self.num_rows, *self.row_shape)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def density(self) -> float:
        return self.nnz / self.num_rows if self.num_rows else 0.0

    def flat_values(self) -> torch.Tensor:
        """Values as a (nnz, row_len) matrix (a view when possible)."""
        return self.values.reshape(self.nnz, self.row_len)

    def with_values(self, values: torch.Tensor) -> SparseGrad:
        return SparseGrad(self.indices, values, self.num_rows, self.name, self.coalesced)

    # ---------------------------------------------------------------- validation
    def validate(self, nonfinite: NonFinitePolicy = "reject") -> SparseGrad:
        """Raise SparseGradError naming the tensor and the offending value; return self."""
        where = f"tensor {self.name!r}"
        if self.indices.dtype not in INDEX_DTYPES:
            raise SparseGradError(f"{where}: index dtype {self.indices.dtype} is not int32 or int64")
        if self.values.dtype not in VALUE_DTYPES:
            raise SparseGradError(
                f"{where}: value dtype {self.values.dtype} is not one of {', '.join(dtypes.NAMES)}"
            )
        if self.indices.dim() != 1:
            raise SparseGradError(f"{where}: indices must be 1-D, got shape {tuple(self.indices.shape)}")
        if self.values.dim() < 1 or self.values.shape[0] != self.indices.shape[0]:
            raise SparseGradError(
                f"{where}: {self.indices.shape[0]} indices but values of shape {tuple(self.values.shape)}"
            )
        if self.num_rows < 0 or self.num_rows >= 2**31:
            raise SparseGradError(f"{where}: num_rows {self.num_rows} outside [0, 2**31)")
        if self.indices.device != self.values.device:
            raise SparseGradError(f"{where}: indices on {self.indices.device}, values on {self.values.device}")
        if self.nnz:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0:
                raise SparseGradError(f"{where}: negative index {lo}")
            if hi >= self.num_rows:
                raise SparseGradError(f"{where}: index {hi} out of range for {self.num_rows} rows")
            bad = first_nonfinite(self.values) if nonfinite == "reject" else None
            if bad is not None:
                pos, value = bad
                raise SparseGradError(f"{where}: non-finite value {value} in row {int(self.indices[pos])}")
        if nonfinite not in ("reject", "pass"):
            raise SparseGradError(f"{where}: non-finite policy {nonfinite!r} is not 'reject' or 'pass'")
        return self

    def check_compatible(self, other: SparseGrad) -> None:
        """Both describe the same dense tensor (shape and dtype)."""
        if self.dense_shape != other.dense_shape:
            raise SparseGradError(
                f"tensor {self.name!r}: dense shape {self.dense_shape} != {other.dense_shape} of {other.name!r}"
            )
        if self.dtype != other.dtype:
            raise SparseGradError(f"tensor {self.name!r}: dtype {self.dtype} != {other.dtype} of {other.name!r}")

    # ---------------------------------------------------------------- conversions
    def coalesce(self, deterministic: bool = True) -> SparseGrad:
        """Sort indices and sum duplicates (incremental aggregation before anything is sent).

        Duplicates are summed in float32 and rounded once. With `deterministic`, sums follow the
        original order of the duplicates (a slot per row or a stable sort, then an ordered sum), on CPU
        and CUDA alike.
        """
        if self.coalesced:
            return self
        idx = self.indices.to(torch.int64)
        if self.nnz == 0:
            return SparseGrad(idx, self.values, self.num_rows, self.name, True)
        if ascending(idx):
            return SparseGrad(idx, self.values, self.num_rows, self.name, True)
        vals = self.flat_values()
        if vals.device.type == "cpu" and self.num_rows <= SLOT_COALESCE_ROWS_PER_INPUT * self.nnz:
            unique, summed = sum_by_slot(idx, vals, self.num_rows)
        else:
            unique, summed = sum_by_sort(idx, vals, deterministic)
        values = summed.to(self.dtype).reshape(unique.numel(), *self.row_shape)
        return SparseGrad(unique, values, self.num_rows, self.name, True)

    def to_dense(self) -> torch.Tensor:
        out = self.values.new_zeros(self.dense_shape)
        if self.nnz:
            out.index_put_((self.indices.to(torch.int64),), self.values, accumulate=True)
        return out

    def to_torch_sparse(self) -> torch.Tensor:
        t = torch.sparse_coo_tensor(
            self.indices.to(torch.int64).unsqueeze(0), self.values, self.dense_shape, check_invariants=False
        )
        return t._coalesced_(True) if self.coalesced else t

    @staticmethod
    def empty(num_rows: int, row_shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", name: str = "grad") -> SparseGrad:
        return SparseGrad(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty((0, *row_shape), dtype=dtype, device=device),
            num_rows, name, True,
        )


def from_torch_sparse(t: torch.Tensor, name: str = "grad") -> SparseGrad:
    """From a torch sparse COO tensor, coalesced or not (as nn.Embedding(sparse=True) makes).

    A tensor sparse in its first dimension only is row-sparse; one sparse in every dimension is
    flattened to an element-sparse 1-D gradient.
    """
    if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
        raise SparseGradError(f"tensor {name!r}: expected a sparse COO tensor, got {getattr(t, 'layout', type(t))}")
    indices, values = t._indices(), t._values()
    if t.sparse_dim() == 1:
        return SparseGrad(indices[0], values, t.shape[0], name, t.is_coalesced())
    if t.dense_dim() == 0:
        flat = torch.zeros_like(indices[0])
        for dim, size in enumerate(t.shape):
            flat = flat * size + indices[dim]
        return SparseGrad(flat, values, math.prod(t.shape), name, False)
    raise SparseGradError(
        f"tensor {name!r}: sparse_dim {t.sparse_dim()} with dense_dim {t.dense_dim()} "
        "is neither row- nor element-sparse"
    )


def from_dense(t: torch.Tensor, name: str = "grad") -> SparseGrad:
    """Keep the rows of `t` that hold any non-zero (a 1-D tensor keeps its non-zero elements)."""
    if t.dim() == 0:
        raise SparseGradError(f"tensor {name!r}: a scalar has no rows")
    flat = t.reshape(t.shape[0], -1)
    rows = (flat != 0).any(dim=1).nonzero().squeeze(1)
    return SparseGrad(rows, t[rows], t.shape[0], name, True)
