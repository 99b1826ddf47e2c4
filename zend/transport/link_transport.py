"""LinkTransport, the base of every network transport: peers, mailboxes, failure handling.

A backend supplies the I/O on one *link* (a socket, a UCX endpoint): dialling, accepting,
sending and receiving handshake messages and frames (frames.py). This base keeps the rest in
one place: one link per pair of ranks (the higher rank dials, the lower accepts), the
handshake (handshake.py) before anything else, messages matched by (source, tag) into
mailboxes, a bound on unclaimed bytes per peer (a receiver stops reading beyond it, so the
sender is held back), a timeout on every wait, immediate failure of pending receives when a
peer's link breaks (the error names the peer), and a background redial when a dialled peer
comes back.

Timeouts, one meaning each:
- `timeout_s` is the *peer timeout* (liveness): a peer that sends nothing at all, not even a
  heartbeat, for that long is lost (frozen host, cut link) and its link is dropped. A link that
  has been quiet for `heartbeat_s` gets a heartbeat frame, so an idle link stays up for ever and
  a slow-but-alive peer is never mistaken for a lost one. Sends never carry a socket timeout
  (the receiving thread reads the same socket): a send to a lost peer ends when the watchdog
  drops its link.
- how long a message may take to come is the caller's `recv(timeout_s=...)` (the step timeout).
- a peer is not judged while this side holds it back (backpressure) or after this process
  itself stood still (`stalled_since`): then silence is ours, not the peer's.
Sealed frames: with security "aead" (the default) every frame after the handshake is
authenticated and encrypted with the link's own keys (sealing.py); a frame that fails its check
drops the link, which fails every step waiting on it. Security "none" sends frames in clear, for
fabrics the operator trusts (both sides must agree, or the handshake refuses).
Aborts: `abort(prefix)` voids a failed step's messages on both sides (frames.ABORT), so a
failed step leaves no message behind in any mailbox and a late one is dropped as it comes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zend.core.comm import CommAborted, CommError, CommTimeout, Communicator, voided
from zend.transport import handshake as hs
from zend.transport.frames import ABORT, DATA, FRAME, GOODBYE, HEARTBEAT, MAX_ABORT_BYTES, FrameError, pack_frame
from zend.transport.receive_pool import ReceivePool
from zend.transport.sealing import SECURITY_MODES, LinkCipher

log = logging.getLogger("zend.transport")
MAX_ABORTED_PREFIXES = 16384  # voided steps remembered (a late message of one is dropped)
# A payload still arriving counts as a sign of life at this rate (ucx:// lands a payload in one
# call, so a big one at a slow rate is not silence); tcp:// counts every chunk instead.
LIVENESS_MIN_RATE = 1 << 20  # bytes/s
REPLAYED_ABORTS = 256  # the most recent aborts, told again to a peer that (re)connects
MAX_HANDSHAKES = 64  # connections being authenticated at once; a flood beyond it is closed at accept
MAX_HANDSHAKES_PER_SOURCE = 16  # ... and from one address: one host cannot take every slot
MAX_DISCARDED_BYTES = 64 << 20  # a message nobody needs, read only to be dropped: larger drops the link
_NOTHING = torch.empty(0, dtype=torch.uint8)


def _abort_body(code: str, reason: str) -> torch.Tensor:
    """An abort frame's payload: the status name and the reason, as JSON (its tag is the prefix)."""
    text = json.dumps({"code": code[:64], "reason": reason[:MAX_ABORT_BYTES - 128]}).encode()
    return torch.frombuffer(bytearray(text[:MAX_ABORT_BYTES]), dtype=torch.uint8)


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
    cipher: LinkCipher | None = None  # the link's frame keys (None: security "none")
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = "not connected yet"
    was_connected: bool = False
    buffered: int = 0  # bytes received and not yet taken by recv
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


class LinkTransport(Communicator):
    """Base of tcp:// and ucx://. Use: `start()`, `connect(peers)`, send/recv, `close()`."""

    scheme = "?"
    sends_copy = True  # a send returns once its bytes are in the socket, or UCX completed it

    def __init__(self, rank: int, world_size: int, *, cluster_id: str, secret: bytes, generation: int = 0,
                 host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 max_buffered_bytes: int = 1 << 30, max_message_bytes: int = 1 << 34,
                 pool_bytes: int = 256 << 20, protocol_version: int = hs.PROTOCOL_VERSION, security: str = "aead"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        if security not in SECURITY_MODES:
            raise ValueError(f"data-plane security {security!r} is not one of {list(SECURITY_MODES)}")
        self.rank, self.world_size = rank, world_size
        self.identity = hs.Identity(protocol_version, cluster_id, world_size, generation, rank, security)
        self.secret = secret
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self.max_message_bytes = max_message_bytes
        self.receive_pool = ReceivePool(pool_bytes)  # received payloads land in reused blocks
        self.peers = {j: Peer(j) for j in range(world_size) if j != rank}
        self.heartbeat_s = max(0.02, min(0.5, timeout_s / 10))  # a quiet link gets a heartbeat this often
        self.stall_limit_s = timeout_s / 2  # a pause of ours this long may have made peers drop us
        self._cond = threading.Condition()
        self._boxes: dict[tuple[int, str], deque[torch.Tensor]] = {}
        self._aborted: OrderedDict[str, tuple[str, str]] = OrderedDict()  # prefix -> (code, reason)
        self.dropped_messages = 0  # messages of aborted steps, dropped on arrival or from a mailbox
        self._last_tick = time.monotonic()  # the watchdog's last round
        self._stalls: deque[tuple[float, float]] = deque(maxlen=64)  # (from, to) of our own pauses
        self._closed = False
        self._closing = threading.Event()  # what the liveness threads sleep on
        self._threads: list[threading.Thread] = []
        self._open_links: list[Any] = []  # every link a receiver may still be reading
        self.accept_error: str | None = None  # why peers cannot connect to us now (None: they can)
        # the owner's judgement of a data or abort frame from a peer, by its (source, kind, tag, size),
        # before it is kept: None takes it, ("discard", why) reads and drops it, ("refuse", why) drops the link
        self.admission: Callable[[int, int, str, int], tuple[str, str] | None] | None = None
        self.discarded_messages = 0  # data frames the admission discarded

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
    def _receive_frames(self, j: int, link: Any, cipher: LinkCipher | None) -> None:
        """Read frames from rank j until the link breaks (raise) or the transport closes; with a
        cipher, open each (sealing.py) and raise FrameError on the first that fails its check."""

    @abstractmethod
    def _send_frame(self, link: Any, header: bytes, data: torch.Tensor) -> None:
        """Send a frame in clear: its header (with the tag), then its payload."""

    @abstractmethod
    def _send_sealed(self, link: Any, head: bytes, cipher: LinkCipher, data: torch.Tensor) -> None:
        """Send a sealed frame: `head` (clear header and sealed tag), then the payload sealed by
        `cipher` (its records, in order)."""

    def _stop_backend(self) -> None:
        """Release listeners and loops (after every link is closed)."""

    def _prepare_link(self, link: Any) -> None:
        """Set a link up for frames, once its handshake is done (before any frame is sent on it)."""

    def _send_control(self, link: Any, cipher: LinkCipher | None, kind: int) -> bool:
        """Send a payload-less control frame (heartbeat, goodbye) without waiting long; False if it
        did not go (the link is full), in which case nothing was sealed. Raises if the link broke, or
        if a sealed frame may or may not have gone (the link's numbering is then unsure)."""
        self._send_on(link, cipher, "", _NOTHING, kind)
        return True

    # ------------------------------------------------------------------ frames
    def _send_on(self, link: Any, cipher: LinkCipher | None, tag: str, data: torch.Tensor, kind: int = DATA) -> None:
        """One frame on `link` (under the peer's send lock: a sealed link's records are numbered)."""
        header = pack_frame(tag, data.numel(), kind)
        if cipher is None:
            self._send_frame(link, header, data)
        else:
            self._send_sealed(link, cipher.seal_head(header[: FRAME.size], header[FRAME.size :]), cipher, data)

    @staticmethod
    def _control_frame(cipher: LinkCipher | None, kind: int) -> bytes:
        """A payload-less control frame's bytes, sealed when the link is."""
        header = pack_frame("", 0, kind)
        return header if cipher is None else cipher.seal_head(header, b"")

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
            self._closing.set()
            links = list(self._open_links)
            self._cond.notify_all()
        for peer in self.peers.values():  # say goodbye, so peers fail their receives now
            link, cipher = peer.link, peer.cipher
            if link is not None and peer.send_lock.acquire(timeout=1.0):
                try:  # best effort, never blocking on a frozen peer
                    self._send_control(link, cipher, GOODBYE)
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

    def start_liveness(self) -> None:
        """Heartbeats and the watchdog (started with the first link)."""
        self._last_tick = time.monotonic()
        self._spawn(self._heartbeat_loop, "heartbeat")
        self._spawn(self._watchdog_loop, "watchdog")

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
        """Authenticate a link a peer opened to us; refuse it (and only it) if that fails, whatever the
        failure: the other side is not authenticated yet, and may send anything, or nothing. The
        whole handshake must be done within the peer timeout (a client trickling bytes is cut)."""
        deadline = threading.Timer(self.timeout_s, self._interrupt_link, (link,))
        deadline.daemon = True
        deadline.start()
        try:
            rank, cipher = hs.accept_side(*self._handshake_io(link), self.identity, self.secret)
        except Exception as exc:
            log.warning("rank %d: refused connection from %s: %s: %s", self.rank, origin, type(exc).__name__,
                        str(exc)[:200])
            self._close_link(link)
            return
        finally:
            deadline.cancel()
        self._attach(rank, link, cipher)

    def _accept_failed(self, exc: BaseException) -> None:
        """The listener could not take a connection: say so (health reads accept_error), once per spell."""
        if self.accept_error is None:
            log.error("rank %d: cannot accept data-plane connections: %s: %s", self.rank, type(exc).__name__, exc)
        self.accept_error = f"cannot accept data-plane connections: {type(exc).__name__}: {exc}"

    def _accept_recovered(self) -> None:
        if self.accept_error is not None:
            log.warning("rank %d: accepting data-plane connections again", self.rank)
            self.accept_error = None

    def _interrupt_link(self, link: Any) -> None:
        """Make a handshake's blocked receive on `link` fail now (its deadline passed). A backend
        whose receives have their own bound may leave this as it is."""

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
                cipher = hs.connect_side(*self._handshake_io(link), self.identity, self.secret, j)
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
            self._attach(j, link, cipher)
            return

    def _attach(self, j: int, link: Any, cipher: LinkCipher | None) -> None:
        peer = self.peers[j]
        with peer.send_lock:  # nothing goes on the new link before the aborts it may have missed
            with self._cond:
                if self._closed:  # a late (re)connection racing with close()
                    self._close_link(link)
                    return
                # published and the list taken at once: a later abort() sends to this link itself
                recent = list(self._aborted.items())[-REPLAYED_ABORTS:]
                first = not any(p.was_connected for p in self.peers.values())
                old, peer.link, peer.error, peer.was_connected = peer.link, link, None, True
                peer.cipher = cipher
                peer.last_heard = peer.last_sent = time.monotonic()
                peer.arriving, peer.connects = 0, peer.connects + 1
                self._open_links.append(link)
                self._cond.notify_all()
            replay_error = self._replay(link, cipher, recent)
        if replay_error is not None:  # it went away at once
            self._fail(j, link, f"dropped its new link: {replay_error}")
            return
        if first:
            self.start_liveness()
        if old is not None:
            self._close_link(old)
        log.info("rank %d: connected to rank %d over %s", self.rank, j, self.scheme)
        self._spawn(self._receive_loop, f"recv{j}", j, link, cipher)

    def _receive_loop(self, j: int, link: Any, cipher: LinkCipher | None) -> None:
        try:
            self._receive_frames(j, link, cipher)
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
            peer.link = peer.cipher = None
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
                self.peers[j].last_heard = time.monotonic()  # we are not reading: its silence is ours
                self._cond.wait(0.2)
            self.peers[j].last_heard = time.monotonic()

    def _heard(self, j: int, arriving: int = 0) -> None:
        """Bytes came from rank j (`arriving`: a payload of that size is now being received in one call)."""
        peer = self.peers[j]
        peer.last_heard, peer.arriving = time.monotonic(), arriving

    def _admit(self, j: int, kind: int, tag: str, size: int) -> bool:
        """Whether to keep a frame from rank j, judged by its tag and size: sealed links and ucx:// ask
        before they reserve room for the payload (the tag comes first there); clear tcp:// reads tag
        and payload in one call, having reserved room, and asks before delivering. Heartbeats,
        goodbyes and messages of a voided step are always kept (the last to be dropped as such);
        data and abort frames as `admission` says. A refusal raises FrameError, which drops the link;
        so does a discarded message over MAX_DISCARDED_BYTES (nobody needs it, nobody holds room for it)."""
        if kind == DATA and size > self.max_message_bytes:
            raise FrameError(f"announced a message of {size} bytes, over the {self.max_message_bytes}-byte limit")
        if kind not in (DATA, ABORT) or self.admission is None or (kind == DATA and self._voided(tag) is not None):
            return True
        verdict = self.admission(j, kind, tag, size)
        if verdict is None:
            return True
        action, why = verdict
        if action == "refuse":
            raise FrameError(f"sent a message this node refuses: {why}")
        if size > MAX_DISCARDED_BYTES:
            raise FrameError(f"sent a message this node refuses: {why}, and its {size} bytes are too many to "
                             "read only to drop")
        with self._cond:
            self.discarded_messages += 1
            count = self.discarded_messages
        if count == 1 or count % 1000 == 0:  # a peer that floods junk must not flood the log too
            log.warning("rank %d: discarded a message from rank %d (%d so far): %s", self.rank, j, count, why)
        return False

    def _received(self, j: int, kind: int, tag: str, payload: torch.Tensor, keep: bool = True) -> None:
        """A whole frame from rank j, by kind (`keep` False: admitted for reading only, then dropped)."""
        self._heard(j)
        if not keep:
            return
        if kind == DATA:
            self._deliver(j, tag, payload)
        elif kind == GOODBYE:
            raise ConnectionError("closed by the peer")
        elif kind == ABORT:  # (admitted: the owner's admission saw its prefix)
            try:
                notice = json.loads(bytes(payload.numpy()).decode())
                code, reason = notice["code"], str(notice["reason"])[:MAX_ABORT_BYTES]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
                raise FrameError(f"sent a malformed abort for {tag[:40]!r}") from None
            if not tag.endswith("/") or tag == "/" or not (isinstance(code, str) and code.isupper()
                                                           and code.replace("_", "").isalpha() and len(code) <= 32):
                raise FrameError(f"sent a malformed abort (prefix {tag[:40]!r}, code {str(code)[:40]!r})")
            with self._cond:
                self._void(tag, code, reason)

    def _payload_buffer(self, size: int) -> torch.Tensor:
        """Where a received payload lands; handed to `recv` as it is (no copy)."""
        return self.receive_pool.take(size)

    def _deliver(self, j: int, tag: str, payload: torch.Tensor) -> None:
        with self._cond:
            if self._voided(tag) is not None:  # its step was aborted: nobody will ever take it
                self.dropped_messages += 1
                return
            self.peers[j].buffered += payload.numel()
            self._boxes.setdefault((j, tag), deque()).append(payload)
            self._cond.notify_all()

    def _live_link(self, dst: int) -> tuple[Any, LinkCipher | None]:
        if dst not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {dst} (world size {self.world_size})")
        peer = self.peers[dst]
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while peer.link is None:  # not connected yet: it may still be starting
                if peer.was_connected:  # lost: fail now, not after a timeout
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                self._cond.wait(min(left, 0.1))
            return peer.link, peer.cipher

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        hit = self._voided(tag)
        if hit is not None:
            raise CommAborted(hit[1], hit[0])
        link, cipher = self._live_link(dst)
        data = payload.contiguous().view(torch.uint8)
        with self.peers[dst].send_lock:
            try:
                self._send_on(link, cipher, tag, data)
                self.peers[dst].last_sent = time.monotonic()
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
            connects = peer.connects  # a message due on a link that broke never comes on its successor
            while True:
                hit = self._voided(tag)
                if hit is not None:
                    raise CommAborted(hit[1], hit[0])
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
                if (peer.link is None and peer.was_connected) or (connects and peer.connects != connects):
                    # gone (or gone and back), and nothing of this tag is buffered: fail now, not at the timeout
                    raise CommError(f"rank {self.rank}: {peer.error or f'rank {src} reconnected while awaited'}")
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

    # ------------------------------------------------------------------ aborts
    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        with self._cond:
            if prefix in self._aborted:
                return  # already voided (here, or by the peer that told us)
            self._void(prefix, code, reason)
            links = [(j, p.link, p.cipher) for j, p in self.peers.items() if p.link is not None]
        body = _abort_body(code, reason)
        for j, link, cipher in links:  # after the step's own messages (one send lock): peers void it too
            try:
                with self.peers[j].send_lock:
                    self._send_on(link, cipher, prefix, body, ABORT)
                self.peers[j].last_sent = time.monotonic()
            except Exception as exc:  # going down, or a frame half-sent: the link is done for
                self._fail(j, link, f"failed while sending an abort: {exc}")

    def _replay(self, link: Any, cipher: LinkCipher | None,
                recent: list[tuple[str, tuple[str, str]]]) -> Exception | None:
        """Tell a (re)connected peer the recent aborts, under the handshake's timeout (a peer that
        stalls here cannot hold us), then set the link up for frames; the error, if it broke."""
        try:
            for prefix, (code, reason) in recent:
                self._send_on(link, cipher, prefix, _abort_body(code, reason), ABORT)
            self._prepare_link(link)
        except Exception as exc:
            return exc
        return None

    def _void(self, prefix: str, code: str, reason: str) -> None:
        """(under _cond) Remember `prefix` as aborted, drop what its mailboxes hold, wake its receivers."""
        if prefix in self._aborted:
            return
        self._aborted[prefix] = (code, reason)
        while len(self._aborted) > MAX_ABORTED_PREFIXES:
            self._aborted.popitem(last=False)
        for key in [k for k in self._boxes if k[1].startswith(prefix)]:
            box = self._boxes.pop(key)
            self.peers[key[0]].buffered -= sum(m.numel() for m in box)
            self.dropped_messages += len(box)
        self._cond.notify_all()

    def _voided(self, tag: str) -> tuple[str, str] | None:
        return voided(self._aborted, tag)

    def mailbox_bytes(self) -> int:
        """Bytes received and not yet taken, over every peer (a failed step must leave none)."""
        with self._cond:
            return sum(p.buffered for p in self.peers.values())

    # ------------------------------------------------------------------ liveness
    def _heartbeat_loop(self) -> None:
        """A heartbeat on every link that has been quiet for heartbeat_s (a send in progress is not quiet)."""
        while not self._closed:
            if self._closing.wait(self.heartbeat_s):  # not _cond: every message notifies that one
                return
            now = time.monotonic()
            for peer in list(self.peers.values()):
                with self._cond:  # the link and its keys as one pair
                    link, cipher = peer.link, peer.cipher
                if link is None or now - peer.last_sent < self.heartbeat_s:
                    continue
                if not peer.send_lock.acquire(blocking=False):
                    continue  # a frame is going out: that is a sign of life already
                try:
                    if peer.link is link and self._send_control(link, cipher, HEARTBEAT):
                        peer.last_sent = time.monotonic()
                except Exception as exc:  # a frame may be half-sent: the link is done for
                    peer.send_lock.release()
                    self._fail(peer.rank, link, f"failed while sending a heartbeat: {exc}")
                    continue
                peer.send_lock.release()

    def _watchdog_loop(self) -> None:
        """Drop the link of a peer that sent nothing for timeout_s; notice our own pauses."""
        while not self._closed:
            if self._closing.wait(self.heartbeat_s):  # not _cond: every message notifies that one
                return
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
        now = time.monotonic()
        with self._cond:
            current = now - self._last_tick  # a pause that the watchdog has not seen end yet
            longest = max([current, *(end - start for start, end in self._stalls if end >= since)])
        return longest if longest > self.stall_limit_s else None
