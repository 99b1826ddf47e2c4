"""Where received messages wait for their `recv`: matched by (source, tag), bounded, voidable.

Each message lands in the mailbox of its (source rank, tag), in arrival order. What a peer has sent and
nobody has taken yet is counted per peer; a receiver stops reading a peer beyond `max_buffered_bytes`
(backpressure: `must_wait`), so a fast sender is held back by TCP rather than by our memory. A failed
step's tags are voided by prefix (`void`): what its mailboxes hold is dropped, a late message of it is
dropped on arrival, and every `take` waiting on it ends with CommAborted. No I/O here: the link
transport delivers, and its receivers and `recv` wait on the shared condition.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from zend.core.comm import CommAborted, CommError, CommTimeout, voided

MAX_ABORTED_PREFIXES = 16384  # voided steps remembered (a late message of one is dropped)


class Mailboxes:
    """Messages by (source, tag). Every method takes `cond`'s lock itself, except those marked (locked),
    which the caller calls holding it; waiters wait on `cond`, which the link transport shares."""

    def __init__(self, cond: threading.Condition, max_buffered_bytes: int):
        self._cond = cond
        self.max_buffered_bytes = max_buffered_bytes
        self._boxes: dict[tuple[int, str], deque[torch.Tensor]] = {}
        self._buffered: dict[int, int] = {}  # peer -> bytes received and not yet taken
        self._aborted: OrderedDict[str, tuple[str, str]] = OrderedDict()  # prefix -> (code, reason)
        self.dropped = 0  # messages of voided steps, dropped on arrival or from a mailbox

    # ------------------------------------------------------------------ arriving
    def deliver(self, src: int, tag: str, payload: torch.Tensor) -> None:
        with self._cond:
            if self.voided(tag) is not None:  # its step was aborted: nobody will ever take it
                self.dropped += 1
                return
            self._buffered[src] = self._buffered.get(src, 0) + payload.numel()
            self._boxes.setdefault((src, tag), deque()).append(payload)
            self._cond.notify_all()

    def must_wait(self, src: int, size: int) -> bool:
        """(locked) Whether a message of `size` bytes from `src` must wait for room before it is read."""
        held = self._buffered.get(src, 0)
        return bool(held) and held + size > self.max_buffered_bytes

    def buffered(self, src: int | None = None) -> int:
        """Bytes received and not yet taken, from `src` or from everyone."""
        with self._cond:
            return self._buffered.get(src, 0) if src is not None else sum(self._buffered.values())

    def holds(self, src: int, prefix: str) -> bool:
        """Whether a message from `src` with a tag under `prefix` waits to be taken."""
        with self._cond:
            return any(s == src and tag.startswith(prefix) for s, tag in self._boxes)

    # ------------------------------------------------------------------ taking
    def take(self, src: int, tag: str, wait_s: float, gone: Callable[[], str | None], closed: Callable[[], bool],
             link_state: Callable[[], str], rank: int) -> torch.Tensor:
        """The next message from `src` under `tag`. CommAborted if its step was voided; CommError as soon as
        `gone()` names why nothing more can come from `src`, or the transport `closed()`; CommTimeout after
        `wait_s`, saying `link_state()`. (Not locked: it waits on the condition.)"""
        key = (src, tag)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                hit = self.voided(tag)
                if hit is not None:
                    raise CommAborted(hit[1], hit[0])
                box = self._boxes.get(key)
                if box:
                    payload = box.popleft()
                    if not box:
                        del self._boxes[key]
                    self._buffered[src] -= payload.numel()
                    self._cond.notify_all()  # room again: a receiver held back may read on
                    return payload
                if closed():
                    raise CommError(f"rank {rank}: transport closed")
                why = gone()
                if why is not None:  # nothing of this tag is buffered, and nothing more can come
                    raise CommError(f"rank {rank}: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {rank}: no message from rank {src} (tag {tag!r}) within {wait_s} s "
                                      f"({link_state()})")
                self._cond.wait(min(left, 0.1))

    # ------------------------------------------------------------------ voiding
    def void(self, prefix: str, code: str, reason: str) -> bool:
        """(locked) Remember `prefix` as aborted, drop what its mailboxes hold, wake their receivers. False if
        it was voided already."""
        if prefix in self._aborted:
            return False
        self._aborted[prefix] = (code, reason)
        while len(self._aborted) > MAX_ABORTED_PREFIXES:
            self._aborted.popitem(last=False)
        for key in [k for k in self._boxes if k[1].startswith(prefix)]:
            box = self._boxes.pop(key)
            self._buffered[key[0]] -= sum(m.numel() for m in box)
            self.dropped += len(box)
        self._cond.notify_all()
        return True

    def voided(self, tag: str) -> tuple[str, str] | None:
        """(code, reason) if `tag`'s step was voided."""
        return voided(self._aborted, tag)

    def recent_aborts(self, count: int) -> list[tuple[str, tuple[str, str]]]:
        """(locked) The last `count` voided prefixes with their (code, reason), oldest first."""
        return list(self._aborted.items())[-count:]
