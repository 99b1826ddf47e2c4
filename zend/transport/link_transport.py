"""LinkTransport, the base of every network transport: peers, mailboxes, failure handling.

A backend supplies the I/O on one *link* (a socket, a UCX endpoint): dialling, accepting,
sending and receiving handshake messages and frames (frames.py). This base keeps the rest in
one place: one link per pair of ranks (the higher rank dials, the lower accepts), the
handshake (handshake.py) before anything else, messages matched by (source, tag) into
mailboxes, a bound on unclaimed bytes per peer (a receiver stops reading beyond it, so the
sender is held back), a timeout on every wait, immediate failure of pending receives when a
peer's link breaks (the error names the peer), and a background redial when a dialled peer
comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zend.core.comm import CommError, CommTimeout, Communicator
from zend.transport import handshake as hs
from zend.transport.frames import GOODBYE, FrameError, pack_frame
from zend.transport.receive_pool import ReceivePool

log = logging.getLogger("zend.transport")


@dataclass
class Peer:
    rank: int
    address: tuple[str, int] | None = None
    link: Any = None  # the backend's connection object, None while down
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = "not connected yet"
    was_connected: bool = False
    buffered: int = 0  # bytes received and not yet taken by recv


@dataclass(frozen=True)
class PeerState:
    """A peer's link as others may see it (status, metrics)."""

    rank: int
    connected: bool
    error: str | None  # why the link is down (None while it is up)


class LinkTransport(Communicator):
    """Base of tcp:// and ucx://. Use: `start()`, `connect(peers)`, send/recv, `close()`."""

    scheme = "?"

    def __init__(self, rank: int, world_size: int, *, cluster_id: str, secret: bytes, generation: int = 0,
                 host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 max_buffered_bytes: int = 1 << 30, max_message_bytes: int = 1 << 34,
                 pool_bytes: int = 256 << 20, protocol_version: int = hs.PROTOCOL_VERSION):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.identity = hs.Identity(protocol_version, cluster_id, world_size, generation, rank)
        self.secret = secret
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self.max_message_bytes = max_message_bytes
        self.receive_pool = ReceivePool(pool_bytes)  # received payloads land in reused blocks
        self.peers = {j: Peer(j) for j in range(world_size) if j != rank}
        self._cond = threading.Condition()
        self._boxes: dict[tuple[int, str], deque[torch.Tensor]] = {}
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._open_links: list[Any] = []  # every link a receiver may still be reading

    # ------------------------------------------------------------------ backend hooks
    @abstractmethod
    def start(self) -> LinkTransport:
        """Listen on (host, port); port 0 picks a free one, readable from `address` after."""

    @abstractmethod
    def _open_link(self, address: tuple[str, int], timeout_s: float) -> Any:
        """Connect to a listening peer; raise OSError (or ConnectionError) if it is not there."""

    @abstractmethod
    def _close_link(self, link: Any) -> None: ...

    @abstractmethod
    def _send_message(self, link: Any, data: bytes) -> None:
        """Send one small message (handshake), delimited."""

    @abstractmethod
    def _recv_message(self, link: Any) -> bytes:
        """Receive one message sent by _send_message."""

    @abstractmethod
    def _receive_frames(self, j: int, link: Any) -> None:
        """Read frames from rank j until the link breaks (raise) or the transport closes."""

    @abstractmethod
    def _send_frame(self, link: Any, header: bytes, data: torch.Tensor) -> None: ...

    def _stop_backend(self) -> None:
        """Release listeners and loops (after every link is closed)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def peer_states(self) -> list[PeerState]:
        with self._cond:
            return [PeerState(j, p.link is not None, p.error) for j, p in sorted(self.peers.items())]

    def connect(self, peers: dict[int, tuple[str, int]], timeout_s: float | None = None) -> None:
        """Dial every lower rank and wait for every higher rank to dial us."""
        for j, addr in peers.items():
            if j != self.rank:
                self.peers[j].address = addr
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for j in range(self.rank):
            self._dial(j, deadline)
        with self._cond:
            while any(p.link is None for p in self.peers.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    missing = sorted(j for j, p in self.peers.items() if p.link is None)
                    raise CommError(f"rank {self.rank}: ranks {missing} did not connect within the timeout"
                                    f" (last errors: {[self.peers[j].error for j in missing]})")
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            links = list(self._open_links)
            self._cond.notify_all()
        for peer in self.peers.values():  # say goodbye, so peers fail their receives now
            link = peer.link
            if link is not None and peer.send_lock.acquire(timeout=1.0):
                try:
                    self._send_frame(link, pack_frame("", 0, GOODBYE), torch.empty(0, dtype=torch.uint8))
                except Exception:
                    pass
                finally:
                    peer.send_lock.release()
        for link in links:  # receivers see their link break and mark the peer down
            self._close_link(link)
        deadline = time.monotonic() + 3.0  # threads are daemons: wait a little, never forever
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._stop_backend()

    def __enter__(self) -> LinkTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=f"{self.scheme}-{self.rank}-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    # ------------------------------------------------------------------ handshake
    def _handshake_io(self, link: Any) -> tuple[hs.SendMessage, hs.RecvMessage]:
        """Send and receive one handshake message on `link`, delimited by the backend."""
        return (lambda message: self._send_message(link, hs.dump(message)),
                lambda: hs.parse(self._recv_message(link)))

    def _accept(self, link: Any, origin: str) -> None:
        """Authenticate a link a peer opened to us; refuse it (and only it) if that fails."""
        try:
            rank = hs.accept_side(*self._handshake_io(link), self.identity, self.secret)
        except (OSError, ConnectionError, hs.HandshakeError, TimeoutError) as exc:
            log.warning("rank %d: refused connection from %s: %s", self.rank, origin, exc)
            self._close_link(link)
            return
        self._attach(rank, link)

    # ------------------------------------------------------------------ links
    def _dial(self, j: int, deadline: float) -> None:
        """Connect to lower rank j, retrying until the deadline (it may still be starting)."""
        peer = self.peers[j]
        if peer.address is None:
            raise CommError(f"rank {self.rank}: no address for rank {j}")
        while True:
            link = None
            try:
                link = self._open_link(peer.address, max(0.1, deadline - time.monotonic()))
                hs.connect_side(*self._handshake_io(link), self.identity, self.secret, j)
            except hs.HandshakeError:
                if link is not None:
                    self._close_link(link)
                raise  # a refusal is final: retrying would be refused again
            except (OSError, ConnectionError, TimeoutError) as exc:  # not there (yet): retry
                if link is not None:
                    self._close_link(link)
                peer.error = f"rank {j} at {peer.address[0]}:{peer.address[1]}: {exc}"
                if time.monotonic() >= deadline or self._closed:
                    raise CommError(f"rank {self.rank}: cannot connect to {peer.error}") from None
                time.sleep(0.05)
                continue
            self._attach(j, link)
            return

    def _attach(self, j: int, link: Any) -> None:
        peer = self.peers[j]
        with self._cond:
            if self._closed:  # a late (re)connection racing with close()
                self._close_link(link)
                return
            old, peer.link, peer.error, peer.was_connected = peer.link, link, None, True
            self._open_links.append(link)
            self._cond.notify_all()
        if old is not None:
            self._close_link(old)
        log.info("rank %d: connected to rank %d over %s", self.rank, j, self.scheme)
        self._spawn(self._receive_loop, f"recv{j}", j, link)

    def _receive_loop(self, j: int, link: Any) -> None:
        try:
            self._receive_frames(j, link)
        except FrameError as exc:
            self._fail(j, link, str(exc))
        except Exception as exc:  # any I/O failure ends this link, with the peer named
            self._fail(j, link, f"disconnected: {exc or type(exc).__name__}")
        finally:
            with self._cond:
                if link in self._open_links:
                    self._open_links.remove(link)

    def _fail(self, j: int, link: Any, reason: str) -> None:
        peer = self.peers[j]
        with self._cond:
            if peer.link is not link:  # already replaced by a reconnection
                return
            addr = f" at {peer.address[0]}:{peer.address[1]}" if peer.address else ""
            peer.error = f"rank {j}{addr} {reason}"
            peer.link = None
            self._cond.notify_all()
        self._close_link(link)
        if not self._closed:
            log.warning("rank %d: %s", self.rank, peer.error)
            if j < self.rank:  # we are the dialling side: bring it back when it returns
                self._spawn(self._redial_loop, f"redial{j}", j)

    def _redial_loop(self, j: int) -> None:
        pause = 0.25  # backs off to 2 s: a peer that left may be gone for good
        while not self._closed and self.peers[j].link is None:
            with self._cond:  # close() wakes this at once
                self._cond.wait_for(lambda: self._closed, pause)
            pause = min(2.0, pause * 2)
            if self._closed:
                return
            try:
                self._dial(j, time.monotonic() + 1.0)
            except (CommError, hs.HandshakeError) as exc:
                self.peers[j].error = f"rank {j}: {exc}"

    # ------------------------------------------------------------------ data
    def _must_wait(self, j: int, size: int) -> bool:
        """Whether a message of `size` bytes from rank j must wait for room (see _reserve)."""
        if size > self.max_message_bytes:
            raise FrameError(f"announced a message of {size} bytes, over the {self.max_message_bytes}-byte limit")
        peer = self.peers[j]
        return bool(peer.buffered) and peer.buffered + size > self.max_buffered_bytes and not self._closed

    def _reserve(self, j: int, size: int) -> None:
        """Backpressure: wait while too many bytes from rank j are unclaimed."""
        with self._cond:
            while self._must_wait(j, size):
                self._cond.wait(0.2)

    def _payload_buffer(self, size: int) -> torch.Tensor:
        """Where a received payload lands; handed to `recv` as it is (no copy)."""
        return self.receive_pool.take(size)

    def _deliver(self, j: int, tag: str, payload: torch.Tensor) -> None:
        with self._cond:
            self.peers[j].buffered += payload.numel()
            self._boxes.setdefault((j, tag), deque()).append(payload)
            self._cond.notify_all()

    def _live_link(self, dst: int) -> Any:
        if dst not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {dst} (world size {self.world_size})")
        peer = self.peers[dst]
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while peer.link is None:  # a reconnection may be under way
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                self._cond.wait(min(left, 0.1))
            return peer.link

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        link = self._live_link(dst)
        data = payload.contiguous().view(torch.uint8)
        header = pack_frame(tag, data.numel())
        with self.peers[dst].send_lock:
            try:
                self._send_frame(link, header, data)
            except (OSError, ConnectionError, TimeoutError) as exc:
                self._fail(dst, link, f"failed while sending: {exc}")
                raise CommError(f"rank {self.rank}: send to {self.peers[dst].error}") from None

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        if src not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {src} (world size {self.world_size})")
        peer = self.peers[src]
        key = (src, tag)
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                box = self._boxes.get(key)
                if box:
                    payload = box.popleft()
                    if not box:
                        del self._boxes[key]
                    peer.buffered -= payload.numel()
                    self._cond.notify_all()
                    return payload
                if self._closed:
                    raise CommError(f"rank {self.rank}: transport closed")
                if peer.link is None and peer.was_connected:
                    # gone, and nothing of this tag is buffered: fail now rather than at the timeout
                    raise CommError(f"rank {self.rank}: {peer.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {self.rank}: no message from rank {src} (tag {tag!r}) "
                                    f"within {wait} s ({peer.error or 'connected'})")
                self._cond.wait(min(left, 0.1))

    def wait_connected(self, j: int, timeout_s: float | None = None) -> None:
        """Block until rank j is (re)connected, e.g. after it restarted."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self.peers[j].link is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CommError(f"rank {self.rank}: rank {j} not connected: {self.peers[j].error}")
                self._cond.wait(min(left, 0.1))
