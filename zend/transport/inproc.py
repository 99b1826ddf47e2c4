"""n ranks in one process, as threads exchanging messages through queues.

Used by the tests and the simulator; a message is handed over by reference, so it costs no
copy, and the byte accounting in Channel is the same as over a network.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from zend.core.comm import CommError, CommTimeout, Communicator

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

    def _box(self, key: tuple[int, int, str]) -> queue.SimpleQueue[torch.Tensor]:
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = queue.SimpleQueue()
        return box

    def post(self, src: int, dst: int, tag: str, payload: torch.Tensor) -> None:
        with self._lock:  # under the lock so that `fetch` never drops a box holding a message
            self._box((src, dst, tag)).put(payload)

    def fetch(self, src: int, dst: int, tag: str, timeout_s: float | None) -> torch.Tensor:
        key = (src, dst, tag)
        with self._lock:
            box = self._box(key)
        try:
            payload = box.get_nowait()
        except queue.Empty:
            if self._baton is not None:
                self._baton.release()
            try:
                payload = box.get(timeout=timeout_s)  # raises queue.Empty
            finally:
                if self._baton is not None:
                    self._baton.acquire()
        with self._lock:
            if box.empty() and self._boxes.get(key) is box:
                del self._boxes[key]  # tags are used once: keep the table small
        return payload

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
        self.cluster.post(self.rank, dst, tag, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        self._check_peer(src)
        try:
            return self.cluster.fetch(src, self.rank, tag, timeout_s)
        except queue.Empty:
            raise CommTimeout(
                f"rank {self.rank}: no message from rank {src} (tag {tag!r}) within {timeout_s} s") from None
