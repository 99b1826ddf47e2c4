"""The point-to-point interface every scheme is written against, and its byte accounting.

A `Communicator` moves opaque messages (1-D uint8 tensors) between ranks, matched by
(source, tag). The in-process cluster implements it for tests and the simulator; the network
transports implement the same two methods. A `Channel` is what a scheme sees during one sync:
tags scoped to that sync, and every byte counted per phase.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from zend.core.sparse import NonFinitePolicy


class CommError(RuntimeError):
    """A message could not be delivered or did not arrive; the message names the peer."""


class CommTimeout(CommError):
    """The peer is still connected but its message did not come in time (it may be slow, not gone)."""


class CommAborted(CommError):
    """The messages under a tag prefix were voided (a step failed here or on a peer); `code` is the
    originator's status name, the message its reason."""

    def __init__(self, message: str, code: str = "ABORTED"):
        super().__init__(message)
        self.code = code


def voided(aborted: Mapping[str, tuple[str, str]], tag: str) -> tuple[str, str] | None:
    """(code, reason) if `tag` is under an aborted prefix of `aborted` (prefixes end at a '/'):
    one lookup per '/' of the tag, however many steps were aborted."""
    if not aborted:
        return None
    end = tag.find("/")
    while end >= 0:
        hit = aborted.get(tag[: end + 1])
        if hit is not None:
            return hit
        end = tag.find("/", end + 1)
    return None


class Communicator(ABC):
    """Point-to-point messaging among `world_size` ranks.

    `send` may return before the message is delivered; the caller must not modify `payload`
    afterwards. `recv` blocks until the message from `src` with `tag` arrives, or raises
    CommError after `timeout_s`. Messages between a pair with the same tag arrive in order.
    """

    rank: int
    world_size: int
    # True where `send` returns only once the payload's bytes are out of it (copied to the kernel or
    # sent): the caller may then write into it again (the dense ring lands its allgather in place)
    sends_copy: bool = False

    @abstractmethod
    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None: ...

    @abstractmethod
    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor: ...

    def exchange(self, sends: Sequence[tuple[int, str, torch.Tensor]], recvs: Sequence[tuple[int, str]],
                 timeout_s: float | None = None) -> list[torch.Tensor]:
        """One round: every (dst, tag, payload) of `sends` sent in order, then every (src, tag) of `recvs`
        received; the messages in the order of `recvs`. A transport with a native engine crosses into it
        once for the whole round; this default is the same sends and recvs one by one."""
        for dst, tag, payload in sends:
            self.send(dst, tag, payload)
        return [self.recv(src, tag, timeout_s) for src, tag in recvs]

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        """Void every message whose tag starts with `prefix` (one step's tags), here and on every
        peer: pending and later recvs and sends of such tags raise CommAborted(reason, code), and
        their messages are dropped, buffered or yet to come. Idempotent. A communicator that cannot
        (one node: nobody to tell) ignores it."""
        return None

    def link_epoch(self, peer: int) -> int:
        """How many links to `peer` were made so far: a change means the link dropped in between, and what
        was in flight on it may never come. Without links (one process): 0, always."""
        return 0

    def wait_relinked(self, peer: int, timeout_s: float) -> bool:
        """After a CommError from `peer`: wait until a link to it is up again (it reconnected: what it
        replays on a new link, its recent aborts, comes first); True if so within timeout_s, False if it
        cannot be (the communicator closed, the peer gone for good). Without links (one process) the
        peer's messages are where they were: True."""
        return True

    def stalled_since(self, since: float) -> float | None:
        """How long this process stood still (SIGSTOP, swap, a long pause) after monotonic time
        `since`, if long enough that peers may have declared it lost; else None."""
        return None

    def voided(self, prefix: str) -> bool:
        """Whether `prefix` (one attempt of one step) was aborted here: by this rank or by a peer's notice,
        which comes also for a step that has not opened here yet. Where nothing is voided: False."""
        return False

    def holds(self, src: int, prefix: str) -> bool:
        """Whether a message from `src` under tag `prefix` has arrived and waits to be taken (nothing is
        taken). A peer's message for a later step says where it is. Where that cannot be seen: False."""
        return False


def barrier(comm: Communicator, tag: str, timeout_s: float | None = None) -> None:
    """Every rank waits for every other (a tiny all-to-all): lines ranks up before a timed step."""
    token = torch.zeros(1, dtype=torch.uint8)
    for j in range(comm.world_size):
        if j != comm.rank:
            comm.send(j, tag, token)
    for j in range(comm.world_size):
        if j != comm.rank:
            comm.recv(j, tag, timeout_s)


@dataclass
class PhaseTraffic:
    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0


@dataclass
class Traffic:
    """Bytes and messages per phase, as this rank saw them (payload bytes, headers included)."""

    phases: dict[str, PhaseTraffic] = field(default_factory=lambda: defaultdict(PhaseTraffic))
    encodings: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def bytes_sent(self) -> int:
        return sum(p.bytes_sent for p in self.phases.values())

    @property
    def bytes_recv(self) -> int:
        return sum(p.bytes_recv for p in self.phases.values())


class Channel:
    """A communicator seen through one sync: scoped tags, counted bytes, and the policy for NaN and
    Inf in what peers send (`nonfinite`: "reject", as for what trainers submit, or "pass")."""

    def __init__(self, comm: Communicator, sync_id: str = "0", timeout_s: float | None = 60.0,
                 nonfinite: NonFinitePolicy = "reject"):
        if nonfinite not in ("reject", "pass"):
            raise ValueError(f"non-finite policy {nonfinite!r} is not 'reject' or 'pass'")
        self.comm = comm
        self.sync_id = sync_id
        self.timeout_s = timeout_s
        self.nonfinite = nonfinite
        self.traffic = Traffic()
        self.device: torch.device | None = None

    def bind_device(self, device: torch.device) -> None:
        """Hand received messages over on this device (a transport may deliver to host memory)."""
        self.device = device

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def sends_copy(self) -> bool:
        return self.comm.sends_copy

    def _tag(self, phase: str, round_: int) -> str:
        return f"{self.sync_id}/{phase}/{round_}"

    def send(self, dst: int, phase: str, payload: torch.Tensor, round_: int = 0) -> None:
        if dst == self.rank:
            raise CommError(f"rank {self.rank} sending to itself in phase {phase!r}")
        self.comm.send(dst, self._tag(phase, round_), payload)
        t = self.traffic.phases[phase]
        t.bytes_sent += payload.numel()
        t.messages_sent += 1

    def recv(self, src: int, phase: str, round_: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        """The message of `phase` from `src`, within `timeout_s` (default: the sync's)."""
        payload = self.comm.recv(src, self._tag(phase, round_), self.timeout_s if timeout_s is None else timeout_s)
        if self.device is not None and payload.device != self.device:
            payload = payload.to(self.device)
        t = self.traffic.phases[phase]
        t.bytes_recv += payload.numel()
        t.messages_recv += 1
        return payload

    def exchange(self, phase: str, sends: Sequence[tuple[int, torch.Tensor]], srcs: Sequence[int], round_: int = 0
                 ) -> list[torch.Tensor]:
        """One round of `phase`: every (dst, payload) sent, then a message from each of `srcs` received (in
        that order), in one call to the communicator (Communicator.exchange)."""
        tag = self._tag(phase, round_)
        if any(dst == self.rank for dst, _ in sends) or self.rank in srcs:
            raise CommError(f"rank {self.rank} exchanging with itself in phase {phase!r}")
        got = self.comm.exchange([(dst, tag, payload) for dst, payload in sends], [(src, tag) for src in srcs],
                                 self.timeout_s)
        t = self.traffic.phases[phase]
        t.bytes_sent += sum(payload.numel() for _, payload in sends)
        t.messages_sent += len(sends)
        if self.device is not None:
            got = [m.to(self.device) if m.device != self.device else m for m in got]
        t.bytes_recv += sum(m.numel() for m in got)
        t.messages_recv += len(got)
        return got

    def note_encoding(self, phase: str, kind: str) -> None:
        self.traffic.encodings[f"{phase}:{kind}"] += 1
