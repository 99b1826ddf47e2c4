"""Faults injected as events into a data plane, for fault drills over in-process nodes.

A test declares what goes wrong and where, per rank, at the level of single messages: "on rank r, at
the k-th send (or recv, or either) of a tag containing X, do Y", where Y is one of

- ``fail``: that operation raises CommError (a link that drops once);
- ``kill``: the rank stops for good, as kill -9 would stop it: that operation and every later one
  raise, what it sent before is delivered and nothing after, its peers' sends to it fail and their
  receives from it fail once its messages are used up, and its aborts reach nobody;
- ``drop``: a send returns but its message is lost;
- ``delay``: the operation waits (a straggler: `seconds`), then goes on;
- ``mark``: nothing happens; the fault's `fired` event is set, for other faults (or the test) to wait on;
- ``cut``: a partition: the rank is cut off from every other (processes alive) until `FaultPlan.heal()`:
  sends across the cut are lost, receives across it fail once what arrived before is used up, its
  aborts reach nobody until the heal (then they are told, as a transport replays its recent aborts
  on a new link), and `wait_relinked` across it waits for the heal.

Every fault can first wait `until` an event is set (another fault's `fired`, or one the test sets), so
that an ordering a sleep could only make likely is certain: "rank 1's link drops at its first pull once
rank 0 has reached the commit" is

    plan = FaultPlan(2)
    commit = plan.mark(0, op="send", tag="/have/")
    plan.fail(1, op="recv", tag="/pull/", until=commit.fired)
    comms = [plan.wrap(cluster.communicator(r)) for r in range(2)]

After the run, `plan.dead` holds the killed ranks, `plan.ops[r]` the operations rank r attempted, and
every fault's `fired` says whether it happened. Modelled on torchft's EventInjector (fail rank r at
step s), one level down: the messages of a step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from zend.core.comm import CommAborted, CommError, CommTimeout, Communicator

ACTIONS = ("fail", "kill", "drop", "delay", "mark", "cut")
OPS = ("send", "recv", "any")


@dataclass
class Fault:
    """One injected event: on rank `rank`, at the `nth` (0-based) operation of kind `op` whose tag
    contains `tag` (None: any tag), wait `until` that event (at most `wait_s`), then do `action`."""

    rank: int
    action: str
    op: str = "any"
    tag: str | None = None
    nth: int = 0
    seconds: float = 0.0  # "delay": how long the operation waits
    until: threading.Event | None = None
    wait_s: float = 60.0
    message: str = ""  # "fail" and "kill": the CommError's text; {rank} and {peer} are filled in
    fired: threading.Event = field(default_factory=threading.Event)
    seen: int = 0  # matching operations so far

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r} is not one of {ACTIONS}")
        if self.op not in OPS:
            raise ValueError(f"fault op {self.op!r} is not one of {OPS}")
        if self.action == "drop" and self.op != "send":
            raise ValueError("only a send can be dropped")

    def matches(self, rank: int, op: str, tag: str) -> bool:
        return (rank == self.rank and self.op in ("any", op) and (self.tag is None or self.tag in tag))


class FaultPlan:
    """The faults of one run over `world_size` ranks, and what they did (`dead`, `ops`, each `fired`)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.faults: list[Fault] = []
        self.dead: set[int] = set()
        self.ops = [0] * world_size
        self.lock = threading.Lock()
        self.isolated: set[int] = set()  # ranks behind a cut, until heal()
        self.healed = threading.Event()
        self.epochs: dict[tuple[int, int], int] = {}  # (rank, peer) -> cuts between them so far: a link's epoch
        self._deferred: list[tuple[Communicator, str, str, str]] = []  # aborts of isolated ranks, told at the heal

    def add(self, fault: Fault) -> Fault:
        if not 0 <= fault.rank < self.world_size:
            raise ValueError(f"fault on rank {fault.rank}: the world has {self.world_size} ranks")
        self.faults.append(fault)
        return fault

    def fail(self, rank: int, **where: object) -> Fault:
        return self.add(Fault(rank, "fail", **where))  # type: ignore[arg-type]

    def kill(self, rank: int, **where: object) -> Fault:
        return self.add(Fault(rank, "kill", **where))  # type: ignore[arg-type]

    def drop(self, rank: int, **where: object) -> Fault:
        return self.add(Fault(rank, "drop", op="send", **where))  # type: ignore[arg-type]

    def delay(self, rank: int, seconds: float = 0.0, **where: object) -> Fault:
        return self.add(Fault(rank, "delay", seconds=seconds, **where))  # type: ignore[arg-type]

    def mark(self, rank: int, **where: object) -> Fault:
        return self.add(Fault(rank, "mark", **where))  # type: ignore[arg-type]

    def cut(self, rank: int, **where: object) -> Fault:
        return self.add(Fault(rank, "cut", **where))  # type: ignore[arg-type]

    def apart(self, a: int, b: int) -> bool:
        """Whether a cut lies between ranks a and b now."""
        with self.lock:
            return (a in self.isolated) != (b in self.isolated)

    def heal(self) -> None:
        """End every cut: the isolated ranks' aborts are told now, and links are up again."""
        with self.lock:
            self.isolated.clear()
            deferred, self._deferred = self._deferred, []
        for inner, prefix, reason, code in deferred:
            inner.abort(prefix, reason, code)
        self.healed.set()

    def wrap(self, inner: Communicator) -> FaultyComm:
        """`inner` (one rank's communicator) with this plan's faults on it."""
        return FaultyComm(self, inner)

    def _due(self, rank: int, op: str, tag: str) -> list[Fault]:
        """Count the operation; the faults it triggers. CommError if the rank was killed before."""
        with self.lock:
            self.ops[rank] += 1
            if rank in self.dead:
                raise CommError(f"node {rank} was killed")
            due = []
            for f in self.faults:
                if f.matches(rank, op, tag):
                    if f.seen == f.nth:
                        due.append(f)
                    f.seen += 1
            return due

    def _apply(self, rank: int, peer: int, due: list[Fault]) -> bool:
        """Do the triggered faults; False if the operation's message is to be dropped."""
        deliver = True
        for f in due:
            if f.until is not None and not f.until.wait(f.wait_s):
                raise AssertionError(f"fault {f.action} on rank {rank}: its event did not come in {f.wait_s} s")
            if f.action == "delay":
                time.sleep(f.seconds)  # the injected fault itself: a rank that is late
            elif f.action == "kill":
                with self.lock:
                    self.dead.add(rank)
                f.fired.set()
                raise CommError((f.message or "node {rank} was killed").format(rank=rank, peer=peer))
            elif f.action == "fail":
                f.fired.set()
                text = f.message or "rank {rank}: the link to rank {peer} dropped"
                raise CommError(text.format(rank=rank, peer=peer))
            elif f.action == "drop":
                deliver = False
            elif f.action == "cut":
                with self.lock:
                    self.isolated.add(rank)
                    for other in range(self.world_size):
                        for pair in [(rank, other), (other, rank)]:
                            self.epochs[pair] = self.epochs.get(pair, 0) + 1
            f.fired.set()
        return deliver


class FaultyComm(Communicator):
    """One rank's communicator with a FaultPlan's faults on it."""

    def __init__(self, plan: FaultPlan, inner: Communicator):
        self.plan, self.inner = plan, inner
        self.rank, self.world_size = inner.rank, inner.world_size

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        deliver = self.plan._apply(self.rank, dst, self.plan._due(self.rank, "send", tag))
        if dst in self.plan.dead:
            raise CommError(f"rank {self.rank}: rank {dst} lost")
        if deliver and not self.plan.apart(self.rank, dst):  # across a cut, a send is lost
            self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        self.plan._apply(self.rank, src, self.plan._due(self.rank, "recv", tag))
        deadline = time.monotonic() + (timeout_s or 30.0)
        while True:  # in slices: a killed peer's receive fails once its messages are used up
            try:
                return self.inner.recv(src, tag, 0.02)
            except CommAborted:
                raise
            except CommTimeout:
                if src in self.plan.dead:
                    raise CommError(f"rank {self.rank}: rank {src} lost") from None
                if self.plan.apart(self.rank, src):
                    raise CommError(f"rank {self.rank}: the link to rank {src} is cut") from None
                if time.monotonic() > deadline:
                    raise

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        if self.rank in self.plan.dead:  # a stopped node tells nobody anything
            return
        with self.plan.lock:
            if self.rank in self.plan.isolated:  # behind a cut: told once it heals
                self.plan._deferred.append((self.inner, prefix, reason, code))
                return
        self.inner.abort(prefix, reason, code)

    def holds(self, src: int, prefix: str) -> bool:
        return self.inner.holds(src, prefix)

    def link_epoch(self, peer: int) -> int:
        with self.plan.lock:
            return self.plan.epochs.get((self.rank, peer), 0)

    def wait_relinked(self, peer: int, timeout_s: float) -> bool:
        if peer in self.plan.dead or self.rank in self.plan.dead:  # a killed rank's links never come back
            return False
        return not self.plan.apart(self.rank, peer) or self.plan.healed.wait(timeout_s)
