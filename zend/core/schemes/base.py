"""What a synchronisation scheme is: a gradient in, the cluster-wide sum out, and the cost.

A scheme's class also carries its traits (is it one of auto's candidates, one auto picks by bytes
alone) and its byte model (`bytes_per_rank`): every list of schemes derives from these and from
the registry, zend.core.schemes.SCHEMES.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from zend.core import kernels
from zend.core.codec import Header, PeerMessageError, decode_units
from zend.core.comm import Channel, Traffic
from zend.core.costmodel import Profile
from zend.core.sparse import ResultPlace, SparseGrad, first_nonfinite


@dataclass
class SyncResult:
    """The summed gradient as this rank received it, and what it cost.

    Imbalance ratios are 1.0 at best. `push_imbalance` is this rank's own (max over partitions
    of n * units it pushed there / units it pushed); the cluster's figure is the max over
    ranks. `push_load_imbalance` (units each partition received) and `pull_imbalance` (units
    each partition aggregated) are cluster-wide and equal on every rank.
    """

    grad: SparseGrad
    scheme: str
    traffic: Traffic
    push_imbalance: float = 1.0
    push_load_imbalance: float = 1.0
    pull_imbalance: float = 1.0
    mean_input_rows: float | None = None  # cluster-wide mean of non-zero rows per rank, when known
    details: dict[str, object] = field(default_factory=dict)

    def to_dense(self) -> torch.Tensor:
        return self.grad.to_dense()


class Scheme(ABC):
    """One way to sum a sparse gradient over all ranks, written against a Channel.

    The options a scheme takes are its constructor's keyword parameters (`make_scheme` passes
    each scheme only those).
    """

    name: str
    auto_candidate: ClassVar[bool] = False  # auto times it against the other candidates (auto.candidates)
    deterministic_candidate: ClassVar[bool] = False  # under deterministic=True auto picks among these by bytes

    @staticmethod
    def bytes_per_rank(profile: Profile) -> float | None:
        """Bytes through the busiest rank's link, each way, for a tensor of this sparsity profile
        (zend.core.costmodel), or None where the scheme has no byte model. auto prunes its candidates
        by it; the simulator's exact counts are another model (zend.simulator.traffic_model)."""
        return None

    @abstractmethod
    def sync(self, ch: Channel, grad: SparseGrad, *, average: bool = False,
             deterministic: bool = False, place: ResultPlace | None = None) -> SyncResult:
        """Every rank calls this with its gradient of the same tensor (same shape and dtype). A scheme
        that can assemble its result in place asks `place` for room (schemes that cannot ignore it)."""

    def checkpoint(self) -> dict[str, Any]:
        """The state a sync may change (auto's trial plan, its counters), for `restore`: a step
        that aborts is retried by every node from the same state, or their schemes would part."""
        return {k: (v.copy() if isinstance(v, list | dict | set) else v) for k, v in vars(self).items()}

    def restore(self, saved: dict[str, Any]) -> None:
        vars(self).clear()
        vars(self).update(saved)


class ExchangeScheme(Scheme):
    """A scheme that talks to the other ranks itself (every one but auto, which picks one of them).

    `sync` is the same for all: coalesce the input, bind received messages to its device, and
    answer a one-rank world at once; each scheme writes only `exchange`, the part that talks to
    the other ranks.
    """

    coalesce_input = True  # a scheme that reads the gradient another way (dense) sets False

    def sync(self, ch: Channel, grad: SparseGrad, *, average: bool = False,
             deterministic: bool = False, place: ResultPlace | None = None) -> SyncResult:
        if self.coalesce_input or ch.world_size == 1:
            grad = grad.coalesce(deterministic)
        ch.bind_device(grad.device)
        if ch.world_size == 1:
            return local_only(grad, ch, self.name)
        return self.exchange(ch, grad, average=average, deterministic=deterministic, place=place)

    @abstractmethod
    def exchange(self, ch: Channel, grad: SparseGrad, *, average: bool, deterministic: bool,
                 place: ResultPlace | None = None) -> SyncResult:
        """The cluster-wide sum of `grad` (coalesced unless `coalesce_input` is off), n >= 2."""


def imbalance(counts: list[int]) -> float:
    """n * max / sum, 1.0 when perfectly even (or when there is nothing)."""
    total = sum(counts)
    return len(counts) * max(counts) / total if total else 1.0


def finish(values32: torch.Tensor, dtype: torch.dtype, average: bool, world_size: int) -> torch.Tensor:
    """Divide by the world size if asked, in float32, then round once to the gradient's dtype."""
    if average and world_size > 1:
        values32 = values32 / world_size
    return values32.to(dtype)


def local_only(grad: SparseGrad, ch: Channel, name: str) -> SyncResult:
    """The world of one rank: the sum (and the average) is the rank's own gradient."""
    return SyncResult(grad, name, ch.traffic, mean_input_rows=float(grad.nnz))


# ---------------------------------------------------------------- what peers send
# A peer's message is checked as strictly as a trainer's gradient: it decodes (magic, version,
# dtype, exact lengths, keys in the receiver's domain), its keys are units of the tensor, and its
# values are finite unless the channel's policy passes NaN and Inf. Any failure is a
# PeerMessageError naming the sender, the receiver and the phase.

@contextmanager
def from_peer(ch: Channel, src: int, phase: str) -> Iterator[None]:
    """Turn a ValueError (a CodecError included) raised while reading rank `src`'s message into a
    PeerMessageError that names it."""
    try:
        yield
    except PeerMessageError:
        raise
    except ValueError as exc:
        raise PeerMessageError(src, ch.rank, phase, str(exc)) from None


def check_finite(ch: Channel, values: torch.Tensor, keys: torch.Tensor | None = None, what: str = "unit") -> None:
    """ValueError naming the first NaN or Inf of `values` (and its key), unless the policy passes them.
    One vectorised pass on CPU float32 (kernels.all_finite); else the daemon's cheap check for trainers'
    parts (one sum, the exact scan only when the sum is not finite)."""
    if ch.nonfinite != "reject":
        return
    if values.dtype == torch.float32 and values.is_contiguous() and kernels.serves(values) \
            and kernels.all_finite(values.reshape(-1).numpy()):
        return
    bad = first_nonfinite(values)  # the twin, and after the kernel saw one, the exact scan that names it
    if bad is not None:
        pos, value = bad
        where = f"{what} {int(keys[pos])}" if keys is not None else f"{what} {pos}"
        raise ValueError(f"non-finite value {value} in {where} (NaN and Inf are rejected)")


def recv_units(ch: Channel, src: int, phase: str, unit_width: int, domain: int, dtype: torch.dtype, *,
               round_: int = 0, keys_ascending: bool = False,
               check_keys: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, Header]:
    """Receive rank `src`'s units message of `phase` and check it (see `decode_units`; `check_keys`
    raises ValueError for keys in the domain that are not the tensor's); PeerMessageError otherwise."""
    return check_units(ch, src, phase, ch.recv(src, phase, round_), unit_width, domain, dtype,
                       keys_ascending=keys_ascending, check_keys=check_keys)


def check_units(ch: Channel, src: int, phase: str, msg: torch.Tensor, unit_width: int, domain: int,
                dtype: torch.dtype, *, keys_ascending: bool = False,
                check_keys: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, Header]:
    """Rank `src`'s units message of `phase`, received in a round (Channel.exchange), checked as recv_units
    checks it."""
    with from_peer(ch, src, phase):
        keys, values, header = decode_units(msg, unit_width, domain, dtype, keys_ascending)
        if check_keys is not None:
            check_keys(keys)
        check_finite(ch, values, keys, "key")
    return keys, values, header
