"""Centralized schemes: every rank ends up aggregating the whole tensor.

- `hc`: SparCML's recursive doubling with incremental aggregation (Hierarchical
  Centralization), for any number of ranks;
- `agsparse`: allgather of every rank's COO, then a local sum (torch gloo, Horovod).
Messages carry whole-tensor units (rows), keyed by row index.
"""

from __future__ import annotations

import torch

from zend.core import costmodel
from zend.core.aggregate import sum_keyed
from zend.core.codec import Encoding, decode_units, encode_units, read_header
from zend.core.comm import Channel
from zend.core.schemes.base import (
    ExchangeScheme,
    ResultPlace,
    SyncResult,
    check_finite,
    check_units,
    finish,
    from_peer,
    recv_units,
)
from zend.core.sparse import SparseGrad

Rows = tuple[torch.Tensor, torch.Tensor]  # (sorted row indices, values (nnz, row_len))


def _encode_rows(ch: Channel, phase: str, rows: Rows, num_rows: int, encodings: tuple[Encoding, ...]
                 ) -> torch.Tensor:
    msg = encode_units(rows[0], rows[1], num_rows, encodings, keys_sorted=True)
    ch.note_encoding(phase, read_header(msg).kind.name)
    return msg


def _send_rows(ch: Channel, dst: int, phase: str, rows: Rows, num_rows: int,
               encodings: tuple[Encoding, ...], round_: int = 0) -> None:
    ch.send(dst, phase, _encode_rows(ch, phase, rows, num_rows, encodings), round_)


def _recv_rows(ch: Channel, src: int, phase: str, grad: SparseGrad, round_: int = 0) -> Rows:
    keys, values, _ = recv_units(ch, src, phase, grad.row_len, grad.num_rows, grad.dtype, round_=round_)
    return keys, values


def _as_grad(rows: Rows, template: SparseGrad) -> SparseGrad:
    keys, values = rows
    return SparseGrad(keys, values.reshape(-1, *template.row_shape), template.num_rows, template.name, True)


class HCScheme(ExchangeScheme):
    """Recursive doubling; for n not a power of two the extra ranks fold into partners first.

    Partners add the same two operands, so both hold the same bits after every round (float
    addition commutes); each round's sum is rounded to the gradient's dtype before it is used,
    exactly as it travels.
    """

    name = "hc"
    encodings = (Encoding.COO, Encoding.BITMAP)
    auto_candidate = True
    deterministic_candidate = True

    @staticmethod
    def bytes_per_rank(profile: costmodel.Profile) -> float:
        return costmodel.bytes_hierarchical(profile)

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        n, me = ch.world_size, ch.rank
        rows: Rows = (grad.indices.to(torch.int64), grad.flat_values())
        power = 1 << (n.bit_length() - 1)
        extra = n - power

        def merge(a: Rows, b: Rows) -> Rows:
            keys, summed = sum_keyed([a, b], deterministic)
            return keys, summed.to(grad.dtype)

        if me >= power:  # fold in, wait for the answer
            _send_rows(ch, me - power, "fold", rows, grad.num_rows, self.encodings)
            rows = _recv_rows(ch, me - power, "unfold", grad)
        else:
            if me < extra:
                rows = merge(rows, _recv_rows(ch, me + power, "fold", grad))
            for level in range(power.bit_length() - 1):  # a level is one round: one call to the communicator
                partner = me ^ (1 << level)
                msg = _encode_rows(ch, "exchange", rows, grad.num_rows, self.encodings)
                got = ch.exchange("exchange", [(partner, msg)], [partner], level)[0]
                theirs = check_units(ch, partner, "exchange", got, grad.row_len, grad.num_rows, grad.dtype)[:2]
                rows = merge(rows, theirs) if me < partner else merge(theirs, rows)
            if me < extra:
                _send_rows(ch, me + power, "unfold", rows, grad.num_rows, self.encodings)
        keys, values = rows
        return SyncResult(_as_grad((keys, finish(values.float(), grad.dtype, average, n)), grad), self.name, ch.traffic)


class AGSparseScheme(ExchangeScheme):
    """Ring allgather of every rank's COO gradient, then each rank sums all n in rank order."""

    name = "agsparse"
    auto_candidate = True

    @staticmethod
    def bytes_per_rank(profile: costmodel.Profile) -> float:
        return costmodel.bytes_allgather(profile)

    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        n, me = ch.world_size, ch.rank
        own = encode_units(grad.indices.to(torch.int64), grad.flat_values(), grad.num_rows, (Encoding.COO,),
                           keys_sorted=True)
        messages: list[torch.Tensor | None] = [None] * n
        messages[me] = own
        nxt, prev = (me + 1) % n, (me - 1) % n
        forward = own
        for step in range(n - 1):  # step s forwards the gradient of rank me - s: one round, one call
            forward = ch.exchange("allgather", [(nxt, forward)], [prev], step)[0]
            messages[(me - step - 1) % n] = forward
        gathered: list[Rows] = []
        for origin, msg in enumerate(messages):
            assert msg is not None
            if origin == me:
                keys, values, _ = decode_units(msg, grad.row_len, grad.num_rows, grad.dtype)
            else:  # checked here, whoever forwarded it: prev is the rank it came from
                with from_peer(ch, prev, "allgather"):
                    try:
                        keys, values, _ = decode_units(msg, grad.row_len, grad.num_rows, grad.dtype)
                        check_finite(ch, values, keys, "row")
                    except ValueError as exc:
                        if origin == prev:
                            raise
                        raise ValueError(f"rank {origin}'s gradient, forwarded: {exc}") from None
            gathered.append((keys, values))
        keys, summed = sum_keyed(gathered, deterministic)
        ch.note_encoding("allgather", "COO")
        return SyncResult(_as_grad((keys, finish(summed, grad.dtype, average, n)), grad), self.name, ch.traffic,
                          mean_input_rows=sum(k.numel() for k, _ in gathered) / n)
