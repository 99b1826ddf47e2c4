"""Ring allreduce of the dense tensor: the baseline every sparse scheme must beat."""

from __future__ import annotations

import math

import torch

from zend.core import costmodel, kernels
from zend.core.codec import CodecError
from zend.core.comm import Channel
from zend.core.schemes import rowset
from zend.core.schemes.base import ExchangeScheme, ResultPlace, SyncResult, check_finite, from_peer
from zend.core.sparse import SparseGrad

# A chunk travels in pieces of about this size, so that summing piece p overlaps with the
# transfer of piece p + 1 and a piece is forwarded as soon as it is summed (pipelining).
PIECE_BYTES = 2 * 1024 * 1024


def _pieces(chunk: torch.Tensor, count: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(chunk, count))


def _as_wire(piece: torch.Tensor) -> torch.Tensor:
    return piece.view(torch.uint8)  # raw bytes, no header and no copy: both ends know the size


def _land(ch: Channel, src: int, got: torch.Tensor, piece: torch.Tensor, phase: str, step: int, add: bool) -> None:
    """piece += (add) or = the piece rank `src` sent, once it is checked: its exact length, and finite
    values unless the policy passes NaN and Inf; PeerMessageError naming `src` otherwise (the piece may
    then be half written: the step fails). On CPU float32 the finite check rides in the same pass."""
    with from_peer(ch, src, phase):
        expected = piece.numel() * piece.element_size()
        if got.dtype != torch.uint8 or got.dim() != 1 or got.numel() != expected:
            raise CodecError(f"step {step}: piece of {got.numel()} {got.dtype} elements, expected {expected} bytes")
        values = got.view(piece.dtype)
        fused = (ch.nonfinite == "reject" and piece.dtype == torch.float32 and piece.is_contiguous()
                 and kernels.serves(piece, values))
        if fused and kernels.land_finite(piece.numpy(), values.numpy(), add):
            return
        check_finite(ch, values, what=f"step {step}, element")  # the torch twin; after the kernel, names the value
        if fused:
            raise AssertionError("land_finite saw a NaN or Inf that check_finite did not")
        (piece.add_ if add else piece.copy_)(values)


class DenseScheme(ExchangeScheme):
    """Reduce-scatter then allgather around a ring, n - 1 steps each, pipelined in pieces.

    Chunk c is summed once, along the ring, in the same order on every run, and then copied:
    every rank gets the same bits. Partial sums travel in the gradient's dtype, as in NCCL, and
    are summed in place in the rank's own dense copy (no float32 round trip for fp32).
    Where `send` copies (tcp://, ucx://: `Communicator.sends_copy`) the allgather lands in place,
    in the rank's own dense copy; otherwise (the in-process transport passes references) a piece
    handed to `send` is never written again, and the allgather lands in a fresh result tensor.
    The result holds exactly the rows some rank sent (`rowset`: their bitmaps OR-reduced around the
    same ring first), not every row of the tensor.
    """

    name = "dense"
    coalesce_input = False  # densifying sums duplicates itself
    auto_candidate = True
    deterministic_candidate = True

    @staticmethod
    def bytes_per_rank(profile: costmodel.Profile) -> float:
        return costmodel.bytes_dense(profile)

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        n, me = ch.world_size, ch.rank
        rows = rowset.union_rows(ch, grad)
        dense = _densify(grad).reshape(-1)
        count = max(1, math.ceil(dense.numel() * dense.element_size() / n / PIECE_BYTES))
        chunks = [_pieces(c, count) for c in torch.tensor_split(dense, n)]
        nxt, prev = (me + 1) % n, (me - 1) % n
        for p, piece in enumerate(chunks[me]):  # step 0 sends this rank's own chunk as it is
            ch.send(nxt, "reduce_scatter", _as_wire(piece), p)
        for step in range(n - 1):  # after it, chunk (me + 1) % n holds the full sum
            recv_c = (me - step - 1) % n
            for p, piece in enumerate(chunks[recv_c]):
                _land(ch, prev, ch.recv(prev, "reduce_scatter", step * count + p), piece, "reduce_scatter", step,
                      add=True)
                if step < n - 2:  # this chunk is what the next step sends: forward it now
                    ch.send(nxt, "reduce_scatter", _as_wire(piece), (step + 1) * count + p)
        owned = (me + 1) % n
        for p, piece in enumerate(chunks[owned]):  # the full sum, averaged in float32, rounded once
            if average and piece.dtype == torch.float32:
                piece.div_(n)
            elif average:
                piece.copy_(piece.float() / n)
            ch.send(nxt, "allgather", _as_wire(piece), p)
        if ch.sends_copy:  # the pieces sent are ours again: no second tensor, no copy of our own chunk
            result, out = dense, chunks
        else:
            result = torch.empty_like(dense)
            out = [_pieces(c, count) for c in torch.tensor_split(result, n)]
            for dst, src in zip(out[owned], chunks[owned], strict=True):
                dst.copy_(src)
        for step in range(n - 1):
            recv_c = (owned - step - 1) % n
            for p, dst in enumerate(out[recv_c]):
                got = ch.recv(prev, "allgather", step * count + p)
                _land(ch, prev, got, dst, "allgather", step, add=False)
                if step < n - 2:  # forward the bytes as they came
                    ch.send(nxt, "allgather", got, (step + 1) * count + p)
        ch.note_encoding("allgather", "DENSE")
        values = result.reshape(grad.dense_shape)
        if rows.numel() < grad.num_rows:
            values = values.index_select(0, rows)
        return SyncResult(SparseGrad(rows, values, grad.num_rows, grad.name, True), self.name, ch.traffic)


def _densify(grad: SparseGrad) -> torch.Tensor:
    if not grad.coalesced:
        return grad.to_dense()  # index_put with accumulate sums duplicates
    out = torch.zeros(grad.dense_shape, dtype=grad.dtype, device=grad.device)
    if grad.nnz:
        out.index_copy_(0, grad.indices.to(torch.int64), grad.values)
    return out
