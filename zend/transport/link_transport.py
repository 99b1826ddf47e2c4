"""LinkTransport, the base of every network transport: the layers of the data plane, composed.

Each layer is a module of its own, and a native engine can take over layers one by one:
- link I/O, per backend (tcp.py, ucx.py): moving a frame's bytes on one link, its receive loop;
- framing (framing.py): a frame in clear, or sealed with the link's keys, one wrapper for any backend;
- mailboxes (mailboxes.py): messages matched by (source, tag), backpressure, void and abort;
- liveness (liveness.py): heartbeats on quiet links, the watchdog on silent peers, our own stalls;
- peer links (peer_links.py): one authenticated link per pair, dialled, accepted, redialled, gated.
What stays here is the glue: `send` and `recv` (the Communicator), aborts told to every peer, and each
arriving frame judged (admission), counted as a sign of life and delivered.

Timeouts, one meaning each: `timeout_s` is the *peer timeout* (liveness); how long a message may take to
come is the caller's `recv(timeout_s=...)` (the step timeout). Sends never carry a socket timeout (the
receiving thread reads the same socket): a send to a lost peer ends when the watchdog drops its link.
Sealed frames: with security "aead" (the default) every frame after the handshake is authenticated and
encrypted with the link's own keys; a frame that fails its check drops the link, which fails every step
waiting on it. Security "none" sends frames in clear (both sides must agree, or the handshake refuses).
Aborts: `abort(prefix)` voids a failed step's messages on both sides (frames.ABORT), so a failed step
leaves no message behind in any mailbox and a late one is dropped as it comes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from zend.core.comm import CommAborted, CommError, Communicator
from zend.transport import handshake as hs
from zend.transport.frames import ABORT, DATA, GOODBYE, HEARTBEAT, MAX_ABORT_BYTES, FrameError
from zend.transport.framing import Frames, frames_for
from zend.transport.liveness import Liveness
from zend.transport.mailboxes import Mailboxes
from zend.transport.peer_links import HandshakeGate, Peer, PeerLinks, PeerState
from zend.transport.receive_pool import PoolStats, ReceivePool
from zend.transport.sealing import SECURITY_MODES, LinkCipher

__all__ = ["MAX_DISCARDED_BYTES", "HandshakeGate", "LinkTransport", "Peer", "PeerState"]
log = logging.getLogger("zend.transport")
REPLAYED_ABORTS = 256  # the most recent aborts, told again to a peer that (re)connects
MAX_DISCARDED_BYTES = 64 << 20  # a message nobody needs, read only to be dropped: larger drops the link
_NOTHING = torch.empty(0, dtype=torch.uint8)


def _abort_body(code: str, reason: str) -> torch.Tensor:
    """An abort frame's payload: the status name and the reason, as JSON (its tag is the prefix)."""
    text = json.dumps({"code": code[:64], "reason": reason[:MAX_ABORT_BYTES - 128]}).encode()
    return torch.frombuffer(bytearray(text[:MAX_ABORT_BYTES]), dtype=torch.uint8)


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
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.receive_pool = ReceivePool(pool_bytes)  # received payloads land in reused blocks
        self._cond = threading.Condition()  # one condition: links coming and going, messages arriving
        self._closing = threading.Event()  # what the liveness threads sleep on
        self._threads: list[threading.Thread] = []
        self.mailboxes = Mailboxes(self._cond, max_buffered_bytes)
        self.links = PeerLinks(rank, world_size, self.identity, secret, timeout_s, self._cond, self, self, self._spawn)
        self.liveness = Liveness(rank, self.links.peers, self._cond, self._closing, timeout_s, self._heartbeat,
                                 self.links.fail)
        # the owner's judgement of a data or abort frame from a peer, by its (source, kind, tag, size),
        # before it is kept: None takes it, ("discard", why) reads and drops it, ("refuse", why) drops the link
        self.admission: Callable[[int, int, str, int], tuple[str, str] | None] | None = None
        self.discarded_messages = 0  # data frames the admission discarded

    # ------------------------------------------------------------------ backend hooks: link I/O
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
    def _receive_frames(self, j: int, link: Any, frames: Frames) -> None:
        """Read frames from rank j until the link breaks (raise) or the transport closes, opening each as
        `frames` says; each one judged (`_admit`), counted (`_heard`) and handed on (`_received`)."""

    @abstractmethod
    def _send_frame(self, link: Any, frames: Frames, head: bytes, data: torch.Tensor) -> None:
        """Send a frame: its head (`frames.head`), then its payload as `frames` puts it on the wire."""

    @abstractmethod
    def _send_control(self, link: Any, frames: Frames, kind: int) -> bool:
        """Send a payload-less control frame (heartbeat, goodbye) without waiting long; False if it did not
        go (the link is full), in which case nothing was sealed. Raises if the link broke, or if a sealed
        frame may or may not have gone (the link's numbering is then unsure)."""

    def _stop_backend(self) -> None:
        """Release listeners and loops (after every link is closed)."""

    def _prepare_link(self, link: Any) -> None:
        """Set a link up for frames, once its handshake is done (before any frame is sent on it)."""

    def _interrupt_link(self, link: Any) -> None:
        """Make a handshake's blocked receive on `link` fail now (its deadline passed). A backend whose
        receives have their own bound may leave this as it is."""

    # ------------------------------------------------------------------ peers and links
    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def peers(self) -> dict[int, Peer]:
        return self.links.peers

    @property
    def accept_error(self) -> str | None:
        """Why peers cannot connect to us now (None: they can); health reads it."""
        return self.links.accept_error

    @property
    def _closed(self) -> bool:
        return self.links.closed

    @property
    def dropped_messages(self) -> int:
        return self.mailboxes.dropped

    def peer_states(self) -> list[PeerState]:
        return self.links.states()

    def connect(self, peers: dict[int, tuple[str, int]], timeout_s: float | None = None) -> None:
        """Dial every lower rank and wait for every higher rank to dial us."""
        self.links.connect(peers, timeout_s or self.timeout_s)

    def wait_connected(self, j: int, timeout_s: float | None = None) -> None:
        """Block until rank j is (re)connected, e.g. after it restarted."""
        self.links.wait_connected(j, self.timeout_s if timeout_s is None else timeout_s)

    def link_epoch(self, peer: int) -> int:
        with self._cond:
            return self.peers[peer].connects

    def wait_relinked(self, peer: int, timeout_s: float) -> bool:
        try:
            self.links.wait_connected(peer, timeout_s)
        except CommError:  # not within timeout_s, or this transport closed (its generation ended)
            return False
        return True

    def link_up(self, j: int, link: Any, cipher: LinkCipher | None, first: bool) -> Exception | None:
        """(PeerLinks, under the peer's send lock) A new link's frames, then the aborts it may have missed,
        told again under the handshake's timeout (a peer that stalls here cannot hold us); liveness starts
        with the first link."""
        frames = frames_for(cipher)
        with self._cond:  # published with the list of aborts: a later abort() sends to this link itself
            self.peers[j].frames = frames
            recent = self.mailboxes.recent_aborts(REPLAYED_ABORTS)
        try:
            for prefix, (code, reason) in recent:
                body = _abort_body(code, reason)
                self._send_frame(link, frames, frames.head(ABORT, prefix, body.numel()), body)
            self._prepare_link(link)
        except Exception as exc:
            return exc
        if first:
            self.liveness.start(self._spawn)
        return None

    def receive_on(self, j: int, link: Any) -> None:
        frames = self.peers[j].frames
        self._spawn(self._receive_loop, f"recv{j}", j, link, frames)

    def _receive_loop(self, j: int, link: Any, frames: Frames) -> None:
        try:
            self._receive_frames(j, link, frames)
        except FrameError as exc:
            self.links.fail(j, link, str(exc))
        except Exception as exc:  # any I/O failure ends this link, with the peer named
            self.links.fail(j, link, f"disconnected: {exc or type(exc).__name__}")
        finally:
            self.links.link_done(link)

    def close(self) -> None:
        with self._cond:
            if self.links.closed:
                return
            self.links.closed = True
            self._closing.set()
            links = list(self.links.open_links)
            self._cond.notify_all()
        for peer in self.peers.values():  # say goodbye, so peers fail their receives now
            link, frames = peer.link, peer.frames
            if link is not None and frames is not None and peer.send_lock.acquire(timeout=1.0):
                try:  # best effort, never blocking on a frozen peer
                    self._send_control(link, frames, GOODBYE)
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

    def _heartbeat(self, peer: Peer, link: Any) -> bool:
        frames = peer.frames
        return frames is not None and self._send_control(link, frames, HEARTBEAT)

    def stalled_since(self, since: float) -> float | None:
        return self.liveness.stalled_since(since)

    # ------------------------------------------------------------------ frames arriving
    def _must_wait(self, j: int, size: int) -> bool:
        """Whether a message of `size` bytes from rank j must wait for room (see _reserve)."""
        if size > self.max_message_bytes:
            raise FrameError(f"announced a message of {size} bytes, over the {self.max_message_bytes}-byte limit")
        return self.mailboxes.must_wait(j, size) and not self._closed

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
        """Whether to keep a frame from rank j, judged by its tag and size before any room is reserved for its
        payload. Heartbeats, goodbyes and messages of a voided step are always kept (the last to be dropped as
        such); data and abort frames as `admission` says. A refusal raises FrameError, which drops the link;
        so does a discarded message over MAX_DISCARDED_BYTES (nobody needs it, nobody holds room for it)."""
        if kind == DATA and size > self.max_message_bytes:
            raise FrameError(f"announced a message of {size} bytes, over the {self.max_message_bytes}-byte limit")
        voided = kind == DATA and self.mailboxes.voided(tag) is not None
        if kind not in (DATA, ABORT) or self.admission is None or voided:
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
            self.mailboxes.deliver(j, tag, payload)
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
                self.mailboxes.void(tag, code, reason)

    def note_last_step(self, job_key: str, tensor: int, last_step: int) -> None:
        """A tensor's last completed step, for a transport that judges frames without asking `admission`
        (the native engine); this one asks."""

    def _payload_buffer(self, size: int) -> torch.Tensor:
        """Where a received payload lands; handed to `recv` as it is (no copy)."""
        return self.receive_pool.take(size)

    # ------------------------------------------------------------------ the Communicator
    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        hit = self.mailboxes.voided(tag)
        if hit is not None:
            raise CommAborted(hit[1], hit[0])
        peer = self.links.live_link(dst)
        data = payload.contiguous().view(torch.uint8)
        with peer.send_lock:
            link, frames = peer.link, peer.frames
            if link is None or frames is None:  # dropped between the wait and the lock
                raise CommError(f"rank {self.rank}: send to {peer.error}")
            try:
                self._send_frame(link, frames, frames.head(DATA, tag, data.numel()), data)
                peer.last_sent = time.monotonic()
            except (OSError, ConnectionError, TimeoutError) as exc:
                self.links.fail(dst, link, f"failed while sending: {exc}")
                raise CommError(f"rank {self.rank}: send to {peer.error}") from None

    def voided(self, prefix: str) -> bool:
        with self._cond:
            return self.mailboxes.voided(prefix) is not None

    def holds(self, src: int, prefix: str) -> bool:
        return self.mailboxes.holds(src, prefix)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        if src not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {src} (world size {self.world_size})")
        peer = self.peers[src]
        with self._cond:
            connects = peer.connects  # a message due on a link that broke never comes on its successor

        def gone() -> str | None:
            if (peer.link is None and peer.was_connected) or (connects and peer.connects != connects):
                return peer.error or f"rank {src} reconnected while awaited"
            return None

        return self.mailboxes.take(src, tag, self.timeout_s if timeout_s is None else timeout_s, gone,
                                   lambda: self._closed, lambda: peer.error or "connected", self.rank)

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        with self._cond:
            if not self.mailboxes.void(prefix, code, reason):
                return  # already voided (here, or by the peer that told us)
            # a link whose frames are not set yet is told by link_up, which reads the voided list after this
            links = [(j, p.link, p.frames) for j, p in self.peers.items() if p.link is not None and p.frames]
        body = _abort_body(code, reason)
        for j, link, frames in links:  # after the step's own messages (one send lock): peers void it too
            assert frames is not None
            try:
                with self.peers[j].send_lock:
                    self._send_frame(link, frames, frames.head(ABORT, prefix, body.numel()), body)
                self.peers[j].last_sent = time.monotonic()
            except Exception as exc:  # going down, or a frame half-sent: the link is done for
                self.links.fail(j, link, f"failed while sending an abort: {exc}")

    def mailbox_bytes(self) -> int:
        """Bytes received and not yet taken, over every peer (a failed step must leave none)."""
        return self.mailboxes.buffered()

    def pool_stats(self) -> PoolStats:
        """The receive pool's counters (received payloads landing in reused blocks)."""
        return self.receive_pool.stats

    def buffered_from(self, src: int) -> int:
        """Bytes received from rank src and not yet taken (what backpressure bounds)."""
        return self.mailboxes.buffered(src)

