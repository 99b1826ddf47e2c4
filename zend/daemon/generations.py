"""Generation changes (--elastic 1), in one place, written as decide-then-act.

`decide` is pure: from what the node sees at one poll (daemons waiting to join, whether the rendezvous
still holds our round, how long each member's link has been down, the bounds) to an action: stay, or
form the next generation and why. `may_stand` is pure too: whether a generation the rendezvous formed
may be taken (it must not leave out a node this node reached over the sealed data plane less than the
dead time ago: the store alone never excludes a live node). `Generations` is the executor: it polls,
asks `decide`, and carries a change out through the daemon's four moves (`Node`): leave the old
generation, join the next round, connect its data plane, resume. Modelled on torch elastic's
`_RendezvousJoinOp -> _Action` split.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from zend.daemon.backoff import Backoff
from zend.daemon.elastic import ElasticRendezvous
from zend.daemon.membership import Membership, MembershipError, first_line

log = logging.getLogger("zend.daemon")
POLL_S = 0.5
RETRY_FIRST_S, RETRY_CAP_S = 1.0, 4.0  # a failed join is tried again after 0.5-1 s, then up to 4 s: never in a
# spin, never long (a refused round waits for a live member: its next try should come soon after)


@dataclass(frozen=True)
class View:
    """What the node sees at one poll."""

    generation: int
    members: tuple[int, ...]  # the --rank of each member of this generation, in zen-rank order
    waiting: int  # daemons on the rendezvous' wait list (a restarted one)
    round_intact: bool  # the rendezvous still holds this generation's round
    down_for: Mapping[int, float]  # --rank -> seconds its link has been down, for members whose link is down
    min_nodes: int
    world_size: int
    dead_after_s: float


@dataclass(frozen=True)
class Stay:
    pass


@dataclass(frozen=True)
class Regenerate:
    reason: str


Action = Stay | Regenerate


def decide(view: View) -> Action:
    """What the node does about its generation now."""
    if view.waiting:
        return Regenerate(f"{view.waiting} node(s) waiting to join generation {view.generation}")
    if not view.round_intact:  # the members moved on (someone left the round): form the next one together
        return Regenerate(f"the rendezvous moved past generation {view.generation}'s round")
    # A node that stood still (SIGSTOP) long enough for the rendezvous to drop it from the round goes on in
    # its generation once its links are back (0.3-0.4 s, benchmarks/fault_recovery.py): joining again
    # would cost every node a new generation (2.5-4 s) and buy nothing. Only scale-in drops a node.
    if view.min_nodes >= view.world_size:
        return Stay()
    gone = sorted(r for r, seconds in view.down_for.items() if seconds >= view.dead_after_s)
    if not gone or len(view.members) - len(gone) < view.min_nodes:
        return Stay()
    return Regenerate("node(s) " + ", ".join(f"--rank {r}" for r in gone) + f" lost for {view.dead_after_s:g} s; "
                      f"going on without it (--min-nodes {view.min_nodes})")


def may_stand(before: Collection[int], new: Membership, reached_at: Mapping[int, float], now: float,
              dead_after_s: float) -> str | None:
    """Why `new` may not be taken (it leaves out a member of `before` that this node reached less than
    `dead_after_s` ago), or None."""
    reached = sorted(r for r in set(before) - set(new.members) if now - reached_at.get(r, float("-inf")) < dead_after_s)
    if not reached:
        return None
    return (f"generation {new.generation} leaves out --rank {', '.join(map(str, reached))}, which this node reached "
            f"less than {dead_after_s:g} s ago: waiting for it to join")


class Node(Protocol):
    """The daemon's moves that a generation change is made of."""

    membership: Membership

    def links_up(self) -> dict[int, bool]: ...  # --rank -> its link is up, for every other member

    def leave(self, reason: str) -> None: ...  # refuse steps, abort this generation's, forget its state

    def connect(self, membership: Membership) -> None: ...  # the data plane of `membership`

    def drop_links(self) -> None: ...

    def still_changing(self, why: str) -> None: ...  # why the next generation has not formed yet (health, status)

    def resume(self, membership: Membership, why: str) -> None: ...  # steps again, in `membership`


class Generations:
    """The executor: watches the rendezvous and the links, and carries out what `decide` says."""

    def __init__(self, elastic: ElasticRendezvous, node: Node, job_steps: Callable[[], dict[str, int]],
                 stopped: threading.Event):
        self.elastic, self.node, self.job_steps, self._stopped = elastic, node, job_steps, stopped
        self._down_since: dict[int, float] = {}  # --rank -> when its link went down
        self._reached_at: dict[int, float] = {}  # --rank -> when this node last had a link up to it

    def watch(self) -> None:
        """Until the daemon stops: poll, decide, act (a thread of its own)."""
        complained = 0.0
        while not self._stopped.wait(POLL_S):
            try:
                action = decide(self.view())
            except MembershipError as exc:  # the store is gone: keep serving this generation, say so
                if time.monotonic() - complained > 30:
                    log.warning("membership store unreachable", extra={"event": "membership_store", "error": str(exc)})
                    complained = time.monotonic()
                continue
            if isinstance(action, Regenerate) and not self._stopped.is_set():
                self.regenerate(action.reason)

    def view(self) -> View:
        m, now = self.node.membership, time.monotonic()
        self._follow_links(now)
        return View(m.generation, m.members or tuple(range(m.world_size)), self.elastic.waiting(),
                    self.elastic.round_intact(), {r: now - since for r, since in self._down_since.items()},
                    self.elastic.min_nodes, self.elastic.world_size, self.elastic.dead_after_s)

    def _follow_links(self, now: float) -> None:
        up = self.node.links_up()
        for r, connected in up.items():
            if connected:
                self._reached_at[r] = now
                self._down_since.pop(r, None)
            else:
                self._down_since.setdefault(r, now)
        for r in set(self._down_since) - set(up):
            del self._down_since[r]

    def regenerate(self, why: str) -> None:
        """Leave this generation and form the next: its steps abort everywhere (their links close), every
        tensor is agreed on again, and the new links carry the new generation. Tries until a round forms
        (or the daemon stops), each failure said in the log."""
        old = self.node.membership
        self._follow_links(time.monotonic())
        log.warning("membership changing", extra={"event": "membership_change", "generation": old.generation,
                                                   "reason": why})
        self.node.leave(f"membership changing after generation {old.generation}: {why}")
        before = old.members or tuple(range(old.world_size))
        backoff = Backoff(RETRY_FIRST_S, RETRY_CAP_S)
        while not self._stopped.is_set():
            try:
                joined = self.elastic.join(self.job_steps())
                refused = may_stand(before, joined, self._reached_at, time.monotonic(), self.elastic.dead_after_s)
                if refused is not None:
                    raise MembershipError(refused)
                if self._stopped.is_set():
                    return
                self.node.connect(joined)
                break
            except Exception as exc:  # no complete round yet, a member lost while connecting: try again
                wait_s = backoff.next()
                log.warning("membership not formed, retrying", extra={"event": "membership_retry", "error": str(exc),
                                                                       "attempt": backoff.attempts, "wait_s": wait_s})
                self.node.drop_links()
                self.node.still_changing(f"{why}; the next generation has not formed (attempt {backoff.attempts}: "
                                         f"{first_line(exc)}); trying again in {wait_s:.1f} s")
                self._stopped.wait(wait_s)
        if self._stopped.is_set():  # stop() came while joining: it could not close what came after it
            self.node.drop_links()
            return
        self._down_since.clear()
        self.node.resume(joined, why)
        log.warning("membership changed", extra={"event": "membership_changed", "generation": joined.generation,
                                                 "nodes": joined.world_size})
