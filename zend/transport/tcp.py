"""tcp://: the data plane over plain sockets, with no dependency beyond the standard library.

A frame is a 20-byte header (magic, version, type, tag length, payload length), the tag, then
the payload, which the per-peer receiver thread reads with `recv_into` straight into the
tensor that `recv` hands out: no copy on the hot path (asyncio streams' readexactly was 3-7x
slower on loopback in our measurements: 0.4-0.9 against 2.8-4.6 GB/s). TCP_NODELAY and 8 MiB
socket buffers, no socket timeout after the handshake (see link_transport.py: liveness is
the heartbeats' job). Handshake messages are length-prefixed. Everything else (handshake flow,
mailboxes, backpressure, failures, redial) is in link_transport.py and handshake.py.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from zend.transport.frames import DATA, FRAME, unpack_frame
from zend.transport.framing import Frames
from zend.transport.handshake import MAX_HANDSHAKE_BYTES
from zend.transport.link_transport import LinkTransport
from zend.transport.peer_links import HandshakeGate
from zend.transport.sealing import CHUNK

SOCKET_BUFFER_BYTES = 8 << 20
SMALL_FRAME_BYTES = 64 << 10  # a payload up to this comes with its tag in one read
CONTROL_SEND_S = 1.0  # the most a heartbeat or goodbye may wait for room once it is sealed
_NOTHING = torch.empty(0, dtype=torch.uint8)
_LENGTH = struct.Struct("<I")
log = logging.getLogger("zend.transport")


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n


def send_within(link: Any, poller: Any, data: bytes, limit_s: float) -> None:
    """Send all of `data` without blocking longer than limit_s in all (a heartbeat thread serves every
    link: one peer that stops reading must not hold it, even in the rare case that the room poll saw
    goes before the frame does). ConnectionError past the limit: a frame half-sent (or sealed, and so
    numbered, and not sent) leaves the link's stream unusable, so the link is dropped."""
    view, sent = memoryview(data), 0
    deadline = time.monotonic() + limit_s
    while sent < len(view):
        try:
            sent += link.send(view[sent:], socket.MSG_DONTWAIT)
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            raise ConnectionError(f"a control frame could not be sent whole within {limit_s:g} s ({sent} of "
                                  f"{len(view)} bytes): the peer reads nothing")


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes of a list of buffers (after a partial vectored read or write)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0], n = views[0][n:], 0


def _recv_exactly_into(sock: socket.socket, views: list[memoryview], progress: Callable[[], None]) -> None:
    """Fill every buffer in order with one recvmsg per arrival: the tag and the payload of a
    frame in one system call, not two. `progress` after each arrival (a big payload at a slow
    rate is not silence)."""
    views = [v for v in views if len(v)]
    while views:
        n = sock.recvmsg_into(views)[0]
        if n == 0:
            raise ConnectionError("connection closed by peer")
        _advance(views, n)
        progress()


def _land(sock: socket.socket, frames: Frames, out: memoryview | None, size: int, record: memoryview,
          progress: Callable[[], None]) -> None:
    """A payload after its tag: in clear, straight into `out` (one call however big); sealed, record by
    record, each opened into its place as it lands. `out` None: read (sealed: opened, as its records are
    numbered) only to be dropped."""
    if out is not None and frames.lands_in_place:
        _recv_exactly_into(sock, [out], progress)
        return
    sink = None if out is not None else memoryview(bytearray(min(size, CHUNK)))
    for start in range(0, size, CHUNK):
        n = min(CHUNK, size - start)
        wire = record[: n + frames.tag_overhead]
        _recv_exactly_into(sock, [wire], progress)
        frames.open_piece(wire, out[start : start + n] if out is not None else sink[:n])  # type: ignore[index]


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """sendall of several buffers with sendmsg: a frame's header and payload leave in one system
    call and, with TCP_NODELAY, without a separate packet for the 40-byte header."""
    views = [b for b in buffers if len(b)]
    while views:
        _advance(views, sock.sendmsg(views))


class TcpTransport(LinkTransport):
    scheme = "tcp"
    _listener: socket.socket | None = None

    def start(self) -> TcpTransport:
        listener = socket.create_server((self.host, self.port))
        listener.settimeout(0.2)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept_loop, "accept")
        return self

    def _accept_loop(self) -> None:
        """Accept, and hand each connection's handshake to a thread of its own, within the gate's
        bounds (per source address and in all; beyond them a connection is closed at once), so that
        no client, silent or slow or many, keeps a restarted peer from getting in. The loop outlives
        any failure: while accept itself fails (out of descriptors), `accept_error` says why."""
        assert self._listener is not None
        gate = HandshakeGate()
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                self.links.accept_failed(exc)
                time.sleep(0.2)  # EMFILE and the like: the backlog waits, the loop lives
                continue
            except Exception as exc:  # never dies, whatever happens
                self.links.accept_failed(exc)
                continue
            self.links.accept_recovered()
            source, origin = addr[0], f"{addr[0]}:{addr[1]}"
            refusal = gate.enter(source)
            if refusal is not None:
                log.warning("rank %d: refused connection from %s: %s", self.rank, origin, refusal)
                self._close_link(sock)
                continue
            try:
                sock.settimeout(self.timeout_s)  # and the whole handshake is bound too (_accept)
                threading.Thread(target=self._handshake_then_leave, args=(sock, origin, gate, source),
                                 name="handshake", daemon=True).start()
            except Exception:  # no thread to be had: this connection only
                gate.leave(source)
                self._close_link(sock)

    def _handshake_then_leave(self, sock: socket.socket, origin: str, gate: HandshakeGate, source: str) -> None:
        try:
            self.links.accept(sock, origin)
        finally:
            gate.leave(source)

    def _interrupt_link(self, link: Any) -> None:
        with contextlib.suppress(OSError):
            link.shutdown(socket.SHUT_RDWR)

    def _stop_backend(self) -> None:
        if self._listener is not None:
            self._listener.close()

    def _open_link(self, address: tuple[str, int], timeout_s: float) -> Any:
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.settimeout(self.timeout_s)
        return sock

    def _close_link(self, link: Any) -> None:
        with contextlib.suppress(OSError):
            link.shutdown(socket.SHUT_RDWR)
        link.close()

    def _send_message(self, link: Any, data: bytes) -> None:
        link.sendall(_LENGTH.pack(len(data)) + data)

    def _recv_message(self, link: Any) -> bytes:
        prefix = bytearray(4)
        _recv_exactly(link, memoryview(prefix))
        (length,) = _LENGTH.unpack(prefix)
        if length > MAX_HANDSHAKE_BYTES:
            raise ConnectionError(f"handshake message of {length} bytes exceeds {MAX_HANDSHAKE_BYTES}")
        body = bytearray(length)
        _recv_exactly(link, memoryview(body))
        return bytes(body)

    def _prepare_link(self, link: Any) -> None:
        sock: socket.socket = link
        for opt, value in ((socket.SO_SNDBUF, SOCKET_BUFFER_BYTES), (socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)):
            sock.setsockopt(socket.SOL_SOCKET, opt, value)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # No timeout on a socket that a receiving thread reads: a send's timeout would also end
        # reads of an idle link. A send to a lost peer ends when the watchdog drops the link.
        sock.settimeout(None)

    def _receive_frames(self, j: int, link: Any, frames: Frames) -> None:
        """Each frame's header, then its tag (a small frame's payload in the same call): the tag opened
        (sealed: checked) and the frame judged before any room is reserved for its payload or more than a
        small one is read; then the payload lands in a pooled block that `recv` hands out as it is."""
        sock: socket.socket = link
        header = bytearray(FRAME.size)
        small = memoryview(bytearray(frames.wire_size(SMALL_FRAME_BYTES)))
        record = memoryview(bytearray(CHUNK + frames.tag_overhead))

        def progress() -> None:
            self._heard(j)

        while True:
            _recv_exactly(sock, memoryview(header))
            self._heard(j)
            kind, tag_len, size = unpack_frame(bytes(header))
            tag_on_wire = bytearray(tag_len + frames.tag_overhead)
            first = small[: frames.wire_size(size)] if size <= SMALL_FRAME_BYTES else small[:0]
            _recv_exactly_into(sock, [memoryview(tag_on_wire), first], progress)
            tag = frames.open_head(bytes(header), bytes(tag_on_wire))
            keep = self._admit(j, kind, tag, size)
            if kind == DATA and keep:  # control frames never wait: an abort may be what frees room
                self._reserve(j, size)
            payload = self._payload_buffer(size) if keep else _NOTHING
            out = memoryview(payload.numpy()) if keep else None  # type: ignore[arg-type]
            if len(first):
                frames.open_all(first, out if out is not None else memoryview(bytearray(size)))
            elif size:
                _land(sock, frames, out, size, record, progress)
            self._received(j, kind, tag, payload, keep)
            del payload, out  # the block goes back to the pool as soon as its reader drops it

    def _send_frame(self, link: Any, frames: Frames, head: bytes, data: torch.Tensor) -> None:
        if data.is_cuda:
            data = data.cpu()  # tcp:// stages GPU tensors through the host
        # the head leaves with the first piece in one sendmsg (in clear: the whole payload); sealed, one
        # record is sealed while the one before drains from the socket buffer
        pieces = frames.pieces(memoryview(data.numpy()))  # type: ignore[arg-type]
        first = next(pieces, None)
        _send_all(link, [memoryview(head)] + ([first] if first is not None else []))
        for piece in pieces:
            _send_all(link, [piece])

    def _send_control(self, link: Any, frames: Frames, kind: int) -> bool:
        # A full socket (the peer holds us back, or is frozen) must not hold the heartbeat thread:
        # the frame is made (sealed: numbered) only once there is room for it, and then goes whole
        poller = select.poll()
        poller.register(link, select.POLLOUT)
        if not poller.poll(0):
            return False
        send_within(link, poller, frames.head(kind, "", 0), CONTROL_SEND_S)
        return True
