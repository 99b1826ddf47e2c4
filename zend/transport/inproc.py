"""n ranks in one process, as threads exchanging messages through queues.

Used by the tests and the simulator; a message is handed over by reference, so it costs no
copy, and the byte accounting in Channel is the same as over a network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from zend.core.comm import CommAborted, CommError, CommTimeout, Communicator, voided

T = TypeVar("T")


class InProcessCluster:
    """Mailboxes for `world_size` ranks; `run` executes one function per rank on threads.

    With `serialize`, one rank runs at a time and hands over only while it waits for a
    message: dozens of rank threads contending for the GIL and the allocator otherwise spend
    most of their time switching (10x slower at 64 ranks on 2 cores).
    """

    def __init__(self, world_size: int, serialize: bool = False):
        if world_size < 1:
            raise ValueError(f"world_size {world_size} must be at least 1")
        self.world_size = world_size
        self._boxes: dict[tuple[int, int, str], queue.SimpleQueue[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._baton: threading.Lock | None = threading.Lock() if serialize else None
        self._aborted: dict[str, tuple[str, str]] = {}  # tag prefix -> (code, reason), seen by every rank at once

    def _box(self, key: tuple[int, int, str]) -> queue.SimpleQueue[torch.Tensor]:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = queue.SimpleQueue()
        return box

    def abort(self, prefix: str, code: str, reason: str) -> None:
        """Void `prefix` for every rank (an abort notice that arrives at once): its messages are dropped."""
        with self._lock:
            self._aborted.setdefault(prefix, (code, reason))
            for key in [k for k in self._boxes if k[2].startswith(prefix)]:
                del self._boxes[key]

    def voided(self, tag: str) -> tuple[str, str] | None:
        return voided(self._aborted, tag)

    def mailbox_messages(self, except_to: frozenset[int] = frozenset()) -> int:
        """Messages posted and not yet fetched, but those to ranks `except_to` (a failed step must leave none)."""
        with self._lock:
            return sum(box.qsize() for key, box in self._boxes.items() if key[1] not in except_to)

    def post(self, src: int, dst: int, tag: str, payload: torch.Tensor) -> None:
        with self._lock:  # under the lock so that `fetch` never drops a box holding a message
            if self.voided(tag) is not None:
                return
            self._box((src, dst, tag)).put(payload)

    def _check(self, tag: str) -> None:
        hit = self.voided(tag)
        if hit is not None:
            raise CommAborted(hit[1], hit[0])

    def fetch(self, src: int, dst: int, tag: str, timeout_s: float | None) -> torch.Tensor:
        key = (src, dst, tag)
        self._check(tag)
        with self._lock:
            box = self._box(key)
        try:
            payload = box.get_nowait()
        except queue.Empty:
            if self._baton is not None:
                self._baton.release()
            try:  # in slices, so that an abort wakes the wait
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                while True:
                    left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                    if left <= 0:
                        raise queue.Empty
                    try:
                        payload = box.get(timeout=left)
                        break
                    except queue.Empty:
                        self._check(tag)
            finally:
                if self._baton is not None:
                    self._baton.acquire()
        with self._lock:
            if box.empty() and self._boxes.get(key) is box:
                del self._boxes[key]  # tags are used once: keep the table small
        return payload

    def holds(self, src: int, dst: int, prefix: str) -> bool:
        """Whether a message from `src` to `dst` under tag `prefix` waits to be fetched."""
        with self._lock:
            return any(key[0] == src and key[1] == dst and key[2].startswith(prefix) and not box.empty()
                       for key, box in self._boxes.items())

    def communicator(self, rank: int) -> InProcessCommunicator:
        return InProcessCommunicator(self, rank)

    def run(self, fn: Callable[[int, Communicator], T], timeout_s: float = 600.0) -> list[T]:
        """Run fn(rank, comm) for every rank concurrently; return results in rank order.

        The first exception of any rank is re-raised (after all threads end).
        """
        results: list[T | None] = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            if self._baton is not None:
                self._baton.acquire()
            try:
                results[rank] = fn(rank, self.communicator(rank))
            except BaseException as exc:
                errors.append(exc)
            finally:
                if self._baton is not None:
                    self._baton.release()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if any(t.is_alive() for t in threads):
            raise CommError(f"in-process cluster: ranks still running after {timeout_s} s")
        if errors:
            raise errors[0]
        return results  # type: ignore[return-value]


class InProcessCommunicator(Communicator):
    def __init__(self, cluster: InProcessCluster, rank: int):
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CommError(f"rank {self.rank}: invalid peer {peer} (world size {self.world_size})")

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        self._check_peer(dst)
        self.cluster._check(tag)
        self.cluster.post(self.rank, dst, tag, payload)

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        self.cluster.abort(prefix, code, reason)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        self._check_peer(src)
        try:
            return self.cluster.fetch(src, self.rank, tag, timeout_s)
        except queue.Empty:
            raise CommTimeout(
                f"rank {self.rank}: no message from rank {src} (tag {tag!r}) within {timeout_s} s") from None

    def holds(self, src: int, prefix: str) -> bool:
        return self.cluster.holds(src, self.rank, prefix)

    def voided(self, prefix: str) -> bool:
        return self.cluster.voided(prefix) is not None
