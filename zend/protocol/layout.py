"""How a registered tensor's gradient lies in a shared buffer: the layout both sides agree on.

Pure layout arithmetic and zero-copy views; the buffers themselves come from zend.buffers.
SPARSE_ROWS: `nnz` int64 row indices at the buffer offset, then, 64-byte aligned, `nnz` rows
of values. DENSE: every element, row-major. Results use the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zend.core import dtypes
from zend.core.sparse import SparseGrad, SparseGradError

LAYOUTS = ("sparse_rows", "dense")
ALIGN = 64
MAX_NAME = 200
MAX_DIMS = 8  # torch's embedding and dense layers need 1-4; more is a mistake or an attack

# view(dtype, byte_offset, count) -> 1-D tensor over the buffer (SharedBuffer.view)
ViewFn = Callable[[torch.dtype, int, int], torch.Tensor]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """One gradient tensor of a job, the same on every trainer of every node."""

    job: str
    name: str
    shape: tuple[int, ...]
    dtype_name: str
    layout: str
    average: bool

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r} of job {self.job!r}"
        if not self.name or len(self.name) > MAX_NAME:
            raise SparseGradError(f"tensor name {self.name[:40]!r} must have 1 to {MAX_NAME} characters")
        if not self.name.isprintable():  # NUL, newline, ...: names reach logs, metrics and status
            bad = next(i for i, c in enumerate(self.name) if not c.isprintable())
            raise SparseGradError(f"tensor name {self.name[:40]!r} has the unprintable character "
                                  f"{self.name[bad]!r} at position {bad}")
        if self.dtype_name not in dtypes.BY_NAME:
            raise SparseGradError(f"{where}: dtype {self.dtype_name!r} is not one of {', '.join(dtypes.NAMES)}")
        if self.layout not in LAYOUTS:
            raise SparseGradError(f"{where}: layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        if len(self.shape) > MAX_DIMS:
            raise SparseGradError(f"{where}: shape has {len(self.shape)} dimensions, more than {MAX_DIMS}")
        if not self.shape or any(d < 1 for d in self.shape) or self.shape[0] >= 2**31:
            raise SparseGradError(f"{where}: shape {list(self.shape)} must have positive sizes and < 2**31 rows")
        if math.prod(self.shape) * self.itemsize >= 1 << 40:
            raise SparseGradError(f"{where}: shape {list(self.shape)} is over 1 TiB")

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.BY_NAME[self.dtype_name].torch

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_len(self) -> int:
        return math.prod(self.row_shape)

    @property
    def dense_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def describe(self) -> dict[str, object]:
        """What every node must agree on before summing this tensor."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype_name, "layout": self.layout,
                "average": self.average}

    def nbytes(self, nnz: int) -> int:
        """Bytes the gradient (or the result) takes in a buffer, from its offset."""
        if self.layout == "dense":
            return self.dense_bytes
        return align(nnz * 8) + nnz * self.row_len * self.itemsize

    @property
    def max_bytes(self) -> int:
        return self.nbytes(self.num_rows)

    def read(self, view: ViewFn, offset: int, nnz: int, check: bool = True) -> SparseGrad:
        """The gradient in a buffer; indices are copied (the other side can still write there), values
        stay a view. With `check` (anything a trainer wrote), SparseGradError names a bad value;
        without (a result the daemon wrote), it is trusted as is and marked coalesced."""
        if self.layout == "dense":
            values = view(self.dtype, offset, math.prod(self.shape)).view(self.shape)
            grad = SparseGrad(torch.arange(self.num_rows, device=values.device), values, self.num_rows, self.name,
                              True)
            return grad.validate() if check else grad
        if nnz < 0:
            raise SparseGradError(f"tensor {self.name!r}: nnz {nnz} is negative")
        indices = view(torch.int64, offset, nnz).clone()
        values = view(self.dtype, offset + align(nnz * 8), nnz * self.row_len).view(nnz, *self.row_shape)
        if not check:
            return SparseGrad(indices, values, self.num_rows, self.name, True)
        return SparseGrad(indices, values, self.num_rows, self.name).validate()

    def write(self, grad: SparseGrad, view: ViewFn, offset: int) -> None:
        """Put a (coalesced) result into a buffer in this tensor's layout."""
        if self.layout == "dense":
            out = view(self.dtype, offset, math.prod(self.shape)).view(self.shape)
            out.zero_()
            if grad.nnz:
                out.index_copy_(0, grad.indices.to(out.device, torch.int64), grad.values.to(out.device, self.dtype))
            return
        indices, values = self.result_views(view, offset, grad.nnz)
        indices.copy_(grad.indices)
        values.copy_(grad.values)

    def result_views(self, view: ViewFn, offset: int, nnz: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices (nnz,) int64, values (nnz, *row_shape)) where a sparse result of nnz rows lies:
        what `write` fills, and where a scheme may assemble the result itself (zend.core.sparse.ResultPlace)."""
        return (view(torch.int64, offset, nnz),
                view(self.dtype, offset + align(nnz * 8), nnz * self.row_len).view(nnz, *self.row_shape))
