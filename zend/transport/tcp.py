"""tcp://: the data plane over plain sockets, with no dependency beyond the standard library.

One connection per pair of ranks (the higher rank connects, the lower accepts), authenticated
by the handshake before any frame is read. A frame is a 20-byte header (magic, version, type,
tag length, payload length), the tag, then the payload, which a per-peer receiver thread reads
with `recv_into` straight into the tensor that `recv` hands out: no copy on the hot path
(asyncio streams' readexactly is several times slower, see the platform notes).

Memory is bounded: a receiver stops reading once `max_buffered_bytes` of unclaimed messages
wait from its peer, and TCP's flow control then holds the sender back. Every wait has a
timeout. A peer that disconnects fails every pending and later operation on it at once, with
an error that names it; a peer that stops answering fails them at their timeout. A restarted
peer is reconnected in the background by the connecting side.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from zend.core.comm import CommError, Communicator
from zend.transport import handshake as hs

log = logging.getLogger("zend.transport.tcp")

FRAME = struct.Struct("<4sBBxxIQ")  # magic, version, type, tag length, payload length
MAGIC = b"ZENT"
FRAME_VERSION = 1
DATA = 1
MAX_TAG_BYTES = 1024
SOCKET_BUFFER_BYTES = 8 << 20


@dataclass
class _Peer:
    rank: int
    address: tuple[str, int] | None = None
    sock: socket.socket | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = "not connected yet"
    was_connected: bool = False
    buffered: int = 0  # bytes received and not yet taken by recv


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n


def _configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


class TcpTransport(Communicator):
    """A rank's endpoint of the tcp:// data plane. `start()`, then `connect(peers)`."""

    scheme = "tcp"

    def __init__(self, rank: int, world_size: int, *, cluster_id: str, secret: bytes, generation: int = 0,
                 host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                 max_buffered_bytes: int = 1 << 30, protocol_version: int = hs.PROTOCOL_VERSION):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.identity = hs.Identity(protocol_version, cluster_id, world_size, generation, rank)
        self.secret = secret
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self.peers = {j: _Peer(j) for j in range(world_size) if j != rank}
        self._cond = threading.Condition()
        self._boxes: dict[tuple[int, str], deque[torch.Tensor]] = {}
        self._closed = False
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def start(self) -> TcpTransport:
        """Bind and listen (port 0 picks a free port: read it back from `address`)."""
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        listener.settimeout(0.2)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept_loop, "accept")
        return self

    def connect(self, peers: dict[int, tuple[str, int]], timeout_s: float | None = None) -> None:
        """Connect to every lower rank and wait for every higher rank to connect to us."""
        for j, addr in peers.items():
            if j != self.rank:
                self.peers[j].address = addr
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        for j in range(self.rank):
            self._dial(j, deadline)
        with self._cond:
            while any(p.sock is None for p in self.peers.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    missing = sorted(j for j, p in self.peers.items() if p.sock is None)
                    raise CommError(f"rank {self.rank}: ranks {missing} did not connect within the timeout"
                                    f" (last errors: {[self.peers[j].error for j in missing]})")
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            socks = [p.sock for p in self.peers.values() if p.sock is not None]
        for sock in socks:  # receivers see the shutdown and mark their peers down
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for t in self._threads:
            t.join(2.0)

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: object, name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=f"tcp-{self.rank}-{name}", daemon=True)  # type: ignore[arg-type]
        t.start()
        self._threads.append(t)

    # ------------------------------------------------------------------ connections
    def _handshake_connector(self, sock: socket.socket, expected_rank: int) -> None:
        nonce = hs.new_nonce()
        self._send_hs(sock, {"type": "hello", "identity": vars(self.identity), "nonce": nonce})
        reply = self._recv_hs(sock)
        if reply.get("type") == "error":
            raise hs.HandshakeError(f"refused by rank {expected_rank}: {reply.get('error')}")
        theirs = hs.identity_of(reply)
        problem = hs.mismatch(self.identity, theirs)
        if problem is None and theirs.rank != expected_rank:
            problem = f"rank {theirs.rank} answered where rank {expected_rank} was expected"
        if problem is None and not hs.verify(self.secret, "acceptor", str(reply.get("nonce")), nonce, theirs,
                                             str(reply.get("mac"))):
            problem = "authentication failed: the peer does not know the cluster secret"
        if problem:
            self._send_hs(sock, {"type": "error", "error": problem})
            raise hs.HandshakeError(f"refused rank {expected_rank}: {problem}")
        mac = hs.proof(self.secret, "connector", nonce, str(reply["nonce"]), self.identity)
        self._send_hs(sock, {"type": "proof", "mac": mac})
        final = self._recv_hs(sock)
        if final.get("type") != "ok":
            raise hs.HandshakeError(f"refused by rank {expected_rank}: {final.get('error')}")

    def _handshake_acceptor(self, sock: socket.socket) -> int:
        hello = self._recv_hs(sock)
        theirs = hs.identity_of(hello)
        problem = hs.mismatch(self.identity, theirs)
        if problem is None and theirs.rank < self.rank:
            problem = f"rank {theirs.rank} must accept, not connect (lower ranks accept)"
        if problem:
            self._send_hs(sock, {"type": "error", "error": problem})
            raise hs.HandshakeError(f"refused a connection claiming rank {theirs.rank}: {problem}")
        nonce = hs.new_nonce()
        mac = hs.proof(self.secret, "acceptor", nonce, str(hello.get("nonce")), self.identity)
        self._send_hs(sock, {"type": "challenge", "identity": vars(self.identity), "nonce": nonce, "mac": mac})
        answer = self._recv_hs(sock)
        if answer.get("type") == "error":
            raise hs.HandshakeError(f"rank {theirs.rank} refused us: {answer.get('error')}")
        if not hs.verify(self.secret, "connector", str(hello.get("nonce")), nonce, theirs, str(answer.get("mac"))):
            problem = "authentication failed: wrong cluster secret"
            self._send_hs(sock, {"type": "error", "error": problem})
            raise hs.HandshakeError(f"refused rank {theirs.rank}: {problem}")
        self._send_hs(sock, {"type": "ok"})
        return theirs.rank

    @staticmethod
    def _send_hs(sock: socket.socket, message: dict[str, object]) -> None:
        sock.sendall(hs.encode(message))

    @staticmethod
    def _recv_hs(sock: socket.socket) -> dict[str, object]:
        prefix = bytearray(4)
        _recv_exactly(sock, memoryview(prefix))
        body = bytearray(hs.decode_length(bytes(prefix)))
        _recv_exactly(sock, memoryview(body))
        return hs.parse(bytes(body))

    def _dial(self, j: int, deadline: float) -> None:
        """Connect to lower rank j, retrying until the deadline (it may still be starting)."""
        peer = self.peers[j]
        if peer.address is None:
            raise CommError(f"rank {self.rank}: no address for rank {j}")
        while True:
            try:
                sock = socket.create_connection(peer.address, timeout=max(0.1, deadline - time.monotonic()))
                sock.settimeout(self.timeout_s)
                try:
                    self._handshake_connector(sock, j)
                except BaseException:
                    sock.close()
                    raise
                self._attach(j, sock)
                return
            except hs.HandshakeError:
                raise
            except OSError as exc:
                peer.error = f"rank {j} at {peer.address[0]}:{peer.address[1]}: {exc}"
                if time.monotonic() >= deadline or self._closed:
                    raise CommError(f"rank {self.rank}: cannot connect to {peer.error}") from None
                time.sleep(0.05)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            sock.settimeout(self.timeout_s)
            try:
                rank = self._handshake_acceptor(sock)
            except (OSError, hs.HandshakeError) as exc:
                log.warning("rank %d: refused connection from %s:%d: %s", self.rank, addr[0], addr[1], exc)
                sock.close()
                continue
            self._attach(rank, sock)

    def _attach(self, j: int, sock: socket.socket) -> None:
        _configure(sock)
        sock.settimeout(None)  # blocking reads in the receiver; sends time out on their own
        peer = self.peers[j]
        with self._cond:
            old, peer.sock, peer.error = peer.sock, sock, None
            peer.was_connected = True
            self._cond.notify_all()
        if old is not None:
            old.close()
        log.info("rank %d: connected to rank %d", self.rank, j)
        self._spawn(self._receive_loop, f"recv{j}", j, sock)

    def _fail(self, j: int, sock: socket.socket, reason: str) -> None:
        peer = self.peers[j]
        with self._cond:
            if peer.sock is not sock:  # already replaced by a reconnection
                return
            addr = f" at {peer.address[0]}:{peer.address[1]}" if peer.address else ""
            peer.error = f"rank {j}{addr} {reason}"
            peer.sock = None
            self._cond.notify_all()
        sock.close()
        if not self._closed:
            log.warning("rank %d: %s", self.rank, peer.error)
            if j < self.rank:  # we are the connecting side: bring it back when it returns
                self._spawn(self._redial_loop, f"redial{j}", j)

    def _redial_loop(self, j: int) -> None:
        while not self._closed and self.peers[j].sock is None:
            try:
                self._dial(j, time.monotonic() + 1.0)
            except (CommError, hs.HandshakeError):
                time.sleep(0.2)

    # ------------------------------------------------------------------ data
    def _receive_loop(self, j: int, sock: socket.socket) -> None:
        header = bytearray(FRAME.size)
        peer = self.peers[j]
        try:
            while True:
                _recv_exactly(sock, memoryview(header))
                magic, version, kind, tag_len, size = FRAME.unpack(header)
                if magic != MAGIC or version != FRAME_VERSION or kind != DATA or tag_len > MAX_TAG_BYTES:
                    raise ValueError(f"sent a malformed frame (magic {magic!r}, version {version}, type {kind}, "
                                     f"tag of {tag_len} bytes)")
                tag_bytes = bytearray(tag_len)
                _recv_exactly(sock, memoryview(tag_bytes))
                with self._cond:  # backpressure: hold off reading while too much is unclaimed
                    while peer.buffered and peer.buffered + size > self.max_buffered_bytes and not self._closed:
                        self._cond.wait(0.2)
                payload = torch.empty(size, dtype=torch.uint8)
                if size:
                    _recv_exactly(sock, memoryview(payload.numpy()))  # type: ignore[arg-type]
                with self._cond:
                    peer.buffered += size
                    self._boxes.setdefault((j, tag_bytes.decode()), deque()).append(payload)
                    self._cond.notify_all()
        except (OSError, ConnectionError) as exc:
            self._fail(j, sock, f"disconnected: {exc}")
        except (ValueError, UnicodeDecodeError) as exc:
            self._fail(j, sock, str(exc))

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        if dst not in self.peers:
            raise CommError(f"rank {self.rank}: invalid peer {dst} (world size {self.world_size})")
        peer = self.peers[dst]
        tag_bytes = tag.encode()
        if len(tag_bytes) > MAX_TAG_BYTES:
            raise CommError(f"tag of {len(tag_bytes)} bytes exceeds {MAX_TAG_BYTES}")
        data = payload.contiguous().view(torch.uint8)
        if data.is_cuda:
            data = data.cpu()  # tcp:// stages GPU tensors through the host
        with self._cond:
            deadline = time.monotonic() + self.timeout_s
            while peer.sock is None:  # a reconnection may be under way
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CommError(f"rank {self.rank}: cannot send to {peer.error}")
                self._cond.wait(min(left, 0.1))
            sock = peer.sock
        head = FRAME.pack(MAGIC, FRAME_VERSION, DATA, len(tag_bytes), data.numel()) + tag_bytes
        with peer.send_lock:
            try:
                sock.settimeout(self.timeout_s)
                sock.sendall(head)
                if data.numel():
                    sock.sendall(memoryview(data.numpy()))  # type: ignore[arg-type]
            except OSError as exc:
                self._fail(dst, sock, f"failed while sending: {exc}")
                raise CommError(f"rank {self.rank}: send to {peer.error}") from None

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
                if peer.sock is None and peer.was_connected:
                    # gone, and nothing of this tag is buffered: fail now rather than at the timeout
                    raise CommError(f"rank {self.rank}: {peer.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommError(f"rank {self.rank}: no message from rank {src} (tag {tag!r}) "
                                    f"within {wait} s ({peer.error or 'connected'})")
                self._cond.wait(min(left, 0.1))

    def wait_connected(self, j: int, timeout_s: float | None = None) -> None:
        """Block until rank j is (re)connected, e.g. after it restarted."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self.peers[j].sock is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise CommError(f"rank {self.rank}: rank {j} not connected: {self.peers[j].error}")
                self._cond.wait(min(left, 0.1))
