"""One authenticated link per pair of ranks: dialling, accepting, the handshake gate, losing and redialling.

The higher rank dials, the lower accepts; nothing crosses a link before its handshake (handshake.py)
has authenticated both sides and agreed its frame keys. A dialled peer that is lost is redialled in the
background (backing off to 2 s), so a restarted peer comes back on its own. Connections not yet
authenticated are bounded in all and per source address (`HandshakeGate`), so no crowd of strangers
keeps a restarted peer out. What a link carries once it is up is the data path's (`Attach`); how bytes
move, the backend's (`LinkIO`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from zend.core.comm import CommError
from zend.transport import handshake as hs
from zend.transport.framing import Frames
from zend.transport.sealing import LinkCipher

log = logging.getLogger("zend.transport")
MAX_HANDSHAKES = 64  # connections being authenticated at once; a flood beyond it is closed at accept
MAX_HANDSHAKES_PER_SOURCE = 16  # ... and from one address: one host cannot take every slot


class HandshakeGate:
    """Bounds on connections not yet authenticated, per source address and in all."""

    def __init__(self, total: int = MAX_HANDSHAKES, per_source: int = MAX_HANDSHAKES_PER_SOURCE):
        self.total, self.per_source = total, per_source
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, source: str) -> str | None:
        """None if a handshake from `source` may start now, else why not."""
        with self._lock:
            if sum(self._pending.values()) >= self.total:
                return f"{self.total} handshakes already pending"
            if self._pending.get(source, 0) >= self.per_source:
                return f"{self.per_source} handshakes from {source} already pending"
            self._pending[source] = self._pending.get(source, 0) + 1
            return None

    def leave(self, source: str) -> None:
        with self._lock:
            left = self._pending.pop(source, 1) - 1
            if left > 0:
                self._pending[source] = left


@dataclass
class Peer:
    rank: int
    address: tuple[str, int] | None = None
    link: Any = None  # the backend's connection object, None while down
    frames: Frames | None = None  # how frames go on the link (clear, or sealed with its keys), set with it
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = "not connected yet"
    was_connected: bool = False
    last_heard: float = 0.0  # monotonic time of the last bytes from this peer
    last_sent: float = 0.0  # ... and of our last frame to it
    arriving: int = 0  # bytes of a payload the backend is receiving in one call (ucx://)
    connects: int = 0  # links made to this peer so far (1 while it never dropped)


@dataclass(frozen=True)
class PeerState:
    """A peer's link as others may see it (status, metrics)."""

    rank: int
    connected: bool
    error: str | None  # why the link is down (None while it is up)


class LinkIO(Protocol):
    """The backend's moves on links (tcp.py, ucx.py)."""

    def _open_link(self, address: tuple[str, int], timeout_s: float) -> Any: ...

    def _close_link(self, link: Any) -> None: ...

    def _send_message(self, link: Any, data: bytes) -> None: ...

    def _recv_message(self, link: Any) -> bytes: ...

    def _interrupt_link(self, link: Any) -> None: ...


class Attach(Protocol):
    """The data path's side of a link coming up and going down (link_transport.py)."""

    def link_up(self, j: int, link: Any, cipher: LinkCipher | None, first: bool) -> Exception | None:
        """(under the peer's send lock) Set the new link up for frames before anything else goes on it;
        the error if it broke at once."""

    def receive_on(self, j: int, link: Any) -> None:
        """Start receiving from rank j on `link`."""


class PeerLinks:
    """Every other rank's link: `connect` at start, then kept up (redial) until `close`."""

    def __init__(self, rank: int, world_size: int, identity: hs.Identity, secret: bytes, timeout_s: float,
                 cond: threading.Condition, io: LinkIO, path: Attach, spawn: Callable[..., None]):
        self.rank, self.identity, self.secret, self.timeout_s = rank, identity, secret, timeout_s
        self.peers = {j: Peer(j) for j in range(world_size) if j != rank}
        self._cond, self._io, self._path, self._spawn = cond, io, path, spawn
        self.closed = False
        self.open_links: list[Any] = []  # every link a receiver may still be reading
        self.accept_error: str | None = None  # why peers cannot connect to us now (None: they can)

    def states(self) -> list[PeerState]:
        with self._cond:
            return [PeerState(j, p.link is not None, p.error) for j, p in sorted(self.peers.items())]

    def connect(self, peers: dict[int, tuple[str, int]], timeout_s: float) -> None:
        """Dial every lower rank and wait for every higher rank to dial us."""
        for j, addr in peers.items():
            if j != self.rank:
                self.peers[j].address = addr
        deadline = time.monotonic() + timeout_s
        for j in range(self.rank):
            self._dial(j, deadline)
        with self._cond:
            while any(p.link is None for p in self.peers.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    missing = sorted(j for j, p in self.peers.items() if p.link is None)
                    raise CommError(f"rank {self.rank}: ranks {missing} did not connect within the timeout"
                                    f" (last errors: {[self.peers[j].error for j in missing]})")
                self._cond.wait(min(left, 0.2))

    def wait_connected(self, j: int, timeout_s: float) -> None:
        """Block until rank j is (re)connected, e.g. after it restarted. CommError once closed, even where j's
        link object is not yet marked down: a closed transport's links carry nothing (a commit holding on j
        would otherwise go round until the step timeout, holding up the next generation)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.closed or self.peers[j].link is None:
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    why = "this transport is closed (its generation ended)" if self.closed else self.peers[j].error
                    raise CommError(f"rank {self.rank}: rank {j} not connected: {why}")
                self._cond.wait(min(left, 0.1))

    def live_link(self, dst: int) -> Peer:
        """Rank dst's peer with a link up, waiting for a first connection up to the timeout; CommError now if
        it was connected and is lost."""
        if dst not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {dst} (world size {len(self.peers) + 1})")
        peer = self.peers[dst]
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while peer.link is None:  # not connected yet: it may still be starting
                if peer.was_connected:  # lost: fail now, not after a timeout
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                self._cond.wait(min(left, 0.1))
            return peer

    # ------------------------------------------------------------------ the handshake
    def _handshake_io(self, link: Any) -> tuple[hs.SendMessage, hs.RecvMessage]:
        return (lambda message: self._io._send_message(link, hs.dump(message)),
                lambda: hs.parse(self._io._recv_message(link)))

    def accept(self, link: Any, origin: str) -> None:
        """Authenticate a link a peer opened to us; refuse it (and only it) if that fails, whatever the
        failure: the other side is not authenticated yet, and may send anything, or nothing. The whole
        handshake must be done within the peer timeout (a client trickling bytes is cut)."""
        deadline = threading.Timer(self.timeout_s, self._io._interrupt_link, (link,))
        deadline.daemon = True
        deadline.start()
        try:
            rank, cipher = hs.accept_side(*self._handshake_io(link), self.identity, self.secret)
        except Exception as exc:
            log.warning("rank %d: refused connection from %s: %s: %s", self.rank, origin, type(exc).__name__,
                        str(exc)[:200])
            self._io._close_link(link)
            return
        finally:
            deadline.cancel()
        self._attach(rank, link, cipher)

    def accept_failed(self, exc: BaseException) -> None:
        """The listener could not take a connection: say so (health reads accept_error), once per spell."""
        if self.accept_error is None:
            log.error("rank %d: cannot accept data-plane connections: %s: %s", self.rank, type(exc).__name__, exc)
        self.accept_error = f"cannot accept data-plane connections: {type(exc).__name__}: {exc}"

    def accept_recovered(self) -> None:
        if self.accept_error is not None:
            log.warning("rank %d: accepting data-plane connections again", self.rank)
            self.accept_error = None

    def _dial(self, j: int, deadline: float) -> None:
        """Connect to lower rank j, retrying until the deadline (it may still be starting)."""
        peer = self.peers[j]
        if peer.address is None:
            raise CommError(f"rank {self.rank}: no address for rank {j}")
        while True:
            link = None
            try:
                link = self._io._open_link(peer.address, max(0.1, deadline - time.monotonic()))
                cipher = hs.connect_side(*self._handshake_io(link), self.identity, self.secret, j)
            except hs.HandshakeError:
                if link is not None:
                    self._io._close_link(link)
                raise  # a refusal is final: retrying would be refused again
            except (OSError, ConnectionError, TimeoutError) as exc:  # not there (yet): retry
                if link is not None:
                    self._io._close_link(link)
                peer.error = f"rank {j} at {peer.address[0]}:{peer.address[1]}: {exc}"
                if time.monotonic() >= deadline or self.closed:
                    raise CommError(f"rank {self.rank}: cannot connect to {peer.error}") from None
                time.sleep(0.05)
                continue
            self._attach(j, link, cipher)
            return

    # ------------------------------------------------------------------ links up and down
    def _attach(self, j: int, link: Any, cipher: LinkCipher | None) -> None:
        peer = self.peers[j]
        with peer.send_lock:  # nothing goes on the new link before the data path has set it up
            with self._cond:
                if self.closed:  # a late (re)connection racing with close()
                    self._io._close_link(link)
                    return
                first = not any(p.was_connected for p in self.peers.values())
                old, peer.link, peer.error, peer.was_connected = peer.link, link, None, True
                peer.last_heard = peer.last_sent = time.monotonic()
                peer.arriving, peer.connects = 0, peer.connects + 1
                self.open_links.append(link)
                self._cond.notify_all()
            broke = self._path.link_up(j, link, cipher, first)
        if broke is not None:  # it went away at once
            self.fail(j, link, f"dropped its new link: {broke}")
            return
        if old is not None:
            self._io._close_link(old)
        log.info("rank %d: connected to rank %d", self.rank, j)
        self._path.receive_on(j, link)

    def fail(self, j: int, link: Any, reason: str) -> None:
        """Rank j's `link` is done for: every receive waiting on it fails now, naming the peer; a dialled peer
        is redialled in the background."""
        peer = self.peers[j]
        with self._cond:
            if peer.link is not link:  # already replaced by a reconnection
                return
            addr = f" at {peer.address[0]}:{peer.address[1]}" if peer.address else ""
            peer.error = f"rank {j}{addr} {reason}"
            peer.link = peer.frames = None
            self._cond.notify_all()
        self._io._close_link(link)
        if not self.closed:
            log.warning("rank %d: %s", self.rank, peer.error)
            if j < self.rank:  # we are the dialling side: bring it back when it returns
                self._spawn(self._redial_loop, f"redial{j}", j)

    def link_done(self, link: Any) -> None:
        """A receiver stopped reading `link`."""
        with self._cond:
            if link in self.open_links:
                self.open_links.remove(link)

    def _redial_loop(self, j: int) -> None:
        pause = 0.25  # backs off to 2 s: a peer that left may be gone for good
        while not self.closed and self.peers[j].link is None:
            with self._cond:  # close() wakes this at once
                self._cond.wait_for(lambda: self.closed, pause)
            pause = min(2.0, pause * 2)
            if self.closed:
                return
            try:
                self._dial(j, time.monotonic() + 1.0)
            except (CommError, hs.HandshakeError) as exc:
                self.peers[j].error = f"rank {j}: {exc}"
