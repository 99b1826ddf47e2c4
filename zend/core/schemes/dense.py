"""Ring allreduce of the dense tensor: the baseline every sparse scheme must beat."""

from __future__ import annotations

import torch

from zend.core.codec import decode_dense, encode_dense
from zend.core.comm import Channel
from zend.core.schemes.base import ExchangeScheme, SyncResult, finish
from zend.core.sparse import SparseGrad


class DenseScheme(ExchangeScheme):
    """Reduce-scatter then allgather around a ring, n - 1 steps each.

    Chunk c is summed once, along the ring, in the same order on every run, and then copied:
    every rank gets the same bits. Partial sums travel in the gradient's dtype, as in NCCL.
    """

    name = "dense"
    coalesce_input = False  # to_dense sums duplicates itself

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool) -> SyncResult:
        n, me = ch.world_size, ch.rank
        dense = grad.to_dense().reshape(-1)
        chunks = list(torch.tensor_split(dense, n))
        nxt, prev = (me + 1) % n, (me - 1) % n
        for step in range(n - 1):  # after it, chunk (me + 1) % n holds the full sum
            send_c, recv_c = (me - step) % n, (me - step - 1) % n
            ch.send(nxt, "reduce_scatter", encode_dense(chunks[send_c]), step)
            got, _ = decode_dense(ch.recv(prev, "reduce_scatter", step), chunks[recv_c].numel(), dense.dtype)
            chunks[recv_c] = (got.float() + chunks[recv_c].float()).to(dense.dtype)
        owned = (me + 1) % n
        chunks[owned] = finish(chunks[owned].float(), dense.dtype, average, n)
        for step in range(n - 1):
            send_c, recv_c = (owned - step) % n, (owned - step - 1) % n
            ch.send(nxt, "allgather", encode_dense(chunks[send_c]), step)
            got, _ = decode_dense(ch.recv(prev, "allgather", step), chunks[recv_c].numel(), dense.dtype)
            chunks[recv_c] = got
        ch.note_encoding("allgather", "DENSE")
        total = torch.cat(chunks).reshape(grad.dense_shape)
        rows = torch.arange(grad.num_rows, device=total.device)
        return SyncResult(SparseGrad(rows, total, grad.num_rows, grad.name, True), self.name, ch.traffic)
