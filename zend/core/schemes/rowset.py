"""Which rows the sum holds: exactly the rows some rank sent, for the schemes that densify.

A sparse sum promises the union of the rows sent, no more (torch's sparse all_reduce on gloo
keeps exactly those; SparseAdam and every optimizer that updates the rows present would move a
row nobody touched). Schemes that send the values of every row (the dense ring) or of whole
blocks (omnireduce) lose that set on the way, so they carry it beside the values: each rank's
rows as a bitmap (one bit per row, 1/8 byte), OR-reduced around the same ring as the dense
tensor, reduce-scatter then allgather: 2(n-1) small messages and 2(n-1)/n x num_rows/8 bytes per
rank, whatever n. A row that every rank sent as zeros stays in the result, as on gloo.
"""

from __future__ import annotations

import numpy as np
import torch

from zend.core.comm import Channel
from zend.core.schemes.base import from_peer
from zend.core.sparse import SparseGrad

PHASE = "rows"
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def bitmap_of(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The rows as a uint8 bitmap of ceil(num_rows / 8) bytes, row r at bit r % 8 of byte r // 8
    (duplicates allowed)."""
    nbytes = (num_rows + 7) // 8
    if rows.device.type != "cpu":
        return _bitmap_on_device(rows, nbytes)
    flags = np.zeros(nbytes * 8, dtype=np.bool_)
    flags[rows.numpy()] = True
    return torch.from_numpy(np.packbits(flags, bitorder="little"))


def _bitmap_on_device(rows: torch.Tensor, nbytes: int) -> torch.Tensor:
    """bitmap_of in torch ops (CUDA tensors: no trip through the host)."""
    present = torch.zeros(nbytes * 8, dtype=torch.uint8, device=rows.device)
    present[rows.long()] = 1
    return (present.view(nbytes, 8) << _SHIFTS.to(rows.device)).sum(1, dtype=torch.int32).to(torch.uint8)


def rows_of(bitmap: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The sorted rows (int64) whose bits are set; bits past num_rows must be clear."""
    if bitmap.device.type != "cpu":
        return _rows_on_device(bitmap, num_rows)
    return torch.from_numpy(np.flatnonzero(np.unpackbits(bitmap.numpy(), bitorder="little")[:num_rows]))


def _rows_on_device(bitmap: torch.Tensor, num_rows: int) -> torch.Tensor:
    """rows_of in torch ops."""
    set_bits = ((bitmap.unsqueeze(1) >> _SHIFTS.to(bitmap.device)) & 1).reshape(-1)[:num_rows]
    return set_bits.nonzero().squeeze(1)


def _check_padding(bitmap: torch.Tensor, num_rows: int) -> None:
    """ValueError if a bit past the tensor's rows is set (a row that does not exist)."""
    spare = bitmap.numel() * 8 - num_rows
    if spare and int(bitmap[-1]) >> (8 - spare):
        raise ValueError(f"row bitmap sets a bit past the tensor's {num_rows} rows")


def union_rows(ch: Channel, grad: SparseGrad) -> torch.Tensor:
    """The sorted rows that any rank of the channel sent (every rank gets the same), by a ring OR of
    the ranks' row bitmaps. Each received piece is checked: its exact length, and no bit set past the
    tensor's rows; PeerMessageError naming the sender otherwise."""
    n, me = ch.world_size, ch.rank
    bitmap = bitmap_of(grad.indices.to(torch.int64), grad.num_rows)
    chunks = list(torch.tensor_split(bitmap, n))
    nxt, prev = (me + 1) % n, (me - 1) % n
    ch.send(nxt, PHASE, chunks[me].clone(), 0)
    for step in range(n - 1):  # reduce-scatter: after it, chunk (me + 1) % n holds every rank's bits
        c = (me - step - 1) % n
        _land(ch, prev, ch.recv(prev, PHASE, step), chunks[c], step, bitmap, grad.num_rows, merge=True)
        if step < n - 2:
            ch.send(nxt, PHASE, chunks[c].clone(), step + 1)
    owned = (me + 1) % n
    ch.send(nxt, PHASE, chunks[owned].clone(), n - 1)
    for step in range(n - 1):  # allgather
        c = (owned - step - 1) % n
        got = ch.recv(prev, PHASE, n - 1 + step)
        _land(ch, prev, got, chunks[c], step, bitmap, grad.num_rows, merge=False)
        if step < n - 2:
            ch.send(nxt, PHASE, got, n + step)
    return rows_of(bitmap, grad.num_rows).to(grad.device)


def _land(ch: Channel, src: int, got: torch.Tensor, chunk: torch.Tensor, step: int, bitmap: torch.Tensor,
          num_rows: int, merge: bool) -> None:
    with from_peer(ch, src, PHASE):
        if got.dtype != torch.uint8 or got.dim() != 1 or got.numel() != chunk.numel():
            raise ValueError(f"step {step}: row bitmap piece of {got.numel()} {got.dtype} elements, expected "
                             f"{chunk.numel()} bytes")
        got = got.to(chunk.device)
        if merge:
            chunk.bitwise_or_(got)
        else:
            chunk.copy_(got)
        _check_padding(bitmap, num_rows)


def restrict(result: SparseGrad, rows: torch.Tensor) -> SparseGrad:
    """`result` (coalesced, holding every row of `rows` and maybe more) cut down to exactly `rows`."""
    if result.nnz == rows.numel():
        return result  # already exactly these rows (both are sorted and unique)
    where = torch.searchsorted(result.indices.to(torch.int64), rows)
    return SparseGrad(rows, result.values.index_select(0, where), result.num_rows, result.name, True)
