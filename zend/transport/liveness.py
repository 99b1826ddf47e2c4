"""Telling a slow peer from a lost one: heartbeats on quiet links, a watchdog on silent peers, our own stalls.

- A link that has been quiet for `heartbeat_s` gets a heartbeat frame, so an idle link stays up for ever
  and a slow-but-alive peer is never mistaken for a lost one.
- A peer that sends nothing at all, not even a heartbeat, for the peer timeout is lost (frozen host, cut
  link): the watchdog drops its link, which fails every receive waiting on it.
- A peer is not judged while we hold it back (backpressure: the receiver keeps its `last_heard` fresh)
  or after this process itself stood still (a gap between two watchdog rounds longer than half the
  timeout): then the silence was ours. `stalled_since` tells the node's commit whether we stood still.
The sends themselves, and what dropping a link does, are the link transport's (callbacks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from zend.transport.peer_links import Peer

log = logging.getLogger("zend.transport")
# A payload still arriving counts as a sign of life at this rate (ucx:// lands a payload in one call, so
# a big one at a slow rate is not silence); tcp:// counts every chunk instead.
LIVENESS_MIN_RATE = 1 << 20  # bytes/s


class Liveness:
    """The heartbeat and watchdog threads of one transport, and what they learnt of our own pauses."""

    def __init__(self, rank: int, peers: Mapping[int, Peer], cond: threading.Condition, closing: threading.Event,
                 timeout_s: float, heartbeat: Callable[[Peer, Any], bool], fail: Callable[[int, Any, str], None]):
        """`heartbeat(peer, link)` sends one on that link without waiting long (False: no room now; raises
        if the link broke); `fail(rank, link, reason)` drops a link."""
        self.rank, self.peers, self._cond, self._closing = rank, peers, cond, closing
        self.timeout_s = timeout_s
        self.heartbeat_s = max(0.02, min(0.5, timeout_s / 10))  # a quiet link gets a heartbeat this often
        self.stall_limit_s = timeout_s / 2  # a pause of ours this long may have made peers drop us
        self._heartbeat, self._fail = heartbeat, fail
        self._last_tick = time.monotonic()  # the watchdog's last round
        self._stalls: deque[tuple[float, float]] = deque(maxlen=64)  # (from, to) of our own pauses

    def start(self, spawn: Callable[[Callable[[], None], str], None]) -> None:
        self._last_tick = time.monotonic()
        spawn(self.heartbeat_loop, "heartbeat")
        spawn(self.watchdog_loop, "watchdog")

    def heartbeat_loop(self) -> None:
        """A heartbeat on every link that has been quiet for heartbeat_s (a send in progress is not quiet)."""
        while not self._closing.wait(self.heartbeat_s):  # not the condition: every message notifies that one
            now = time.monotonic()
            for peer in list(self.peers.values()):
                with self._cond:  # the link and its keys as one pair
                    link = peer.link
                if link is None or now - peer.last_sent < self.heartbeat_s:
                    continue
                if not peer.send_lock.acquire(blocking=False):
                    continue  # a frame is going out: that is a sign of life already
                try:
                    if peer.link is link and self._heartbeat(peer, link):
                        peer.last_sent = time.monotonic()
                except Exception as exc:  # a frame may be half-sent: the link is done for
                    peer.send_lock.release()
                    self._fail(peer.rank, link, f"failed while sending a heartbeat: {exc}")
                    continue
                peer.send_lock.release()

    def watchdog_loop(self) -> None:
        """Drop the link of a peer that sent nothing for timeout_s; notice our own pauses."""
        while not self._closing.wait(self.heartbeat_s):
            now = time.monotonic()
            gap = now - self._last_tick
            if gap > self.stall_limit_s:  # we stood still: the silence was ours, judge nobody this round
                self._stalls.append((self._last_tick, now))
                log.warning("rank %d: this process stood still for %.1f s (peer timeout %g s)",
                            self.rank, gap, self.timeout_s)
                for peer in self.peers.values():
                    peer.last_heard = max(peer.last_heard, now)
                self._last_tick = now
                continue
            for j, peer in list(self.peers.items()):
                link = peer.link
                silent = now - peer.last_heard
                if link is not None and silent > self.timeout_s + peer.arriving / LIVENESS_MIN_RATE:
                    self._fail(j, link, f"sent nothing for {silent:.1f} s (peer timeout {self.timeout_s:g} s): "
                                        "frozen, overloaded or cut off")
            self._last_tick = time.monotonic()  # after the closes (slow over ucx://): they are not a stall

    def stalled_since(self, since: float) -> float | None:
        """How long this process stood still after monotonic time `since`, if long enough that peers may have
        declared it lost; else None."""
        now = time.monotonic()
        with self._cond:
            current = now - self._last_tick  # a pause that the watchdog has not seen end yet
            longest = max([current, *(end - start for start, end in self._stalls if end >= since)])
        return longest if longest > self.stall_limit_s else None
