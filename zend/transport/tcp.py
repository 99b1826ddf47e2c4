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
from zend.transport.handshake import MAX_HANDSHAKE_BYTES
from zend.transport.link_transport import MAX_DISCARDED_BYTES, HandshakeGate, LinkTransport
from zend.transport.sealing import CHUNK, GCM_TAG, LinkCipher

SOCKET_BUFFER_BYTES = 8 << 20
SMALL_FRAME_BYTES = 64 << 10  # a sealed payload up to this comes with its tag in one read
_LENGTH = struct.Struct("<I")
log = logging.getLogger("zend.transport")


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by peer")
        got += n


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


def _recv_sealed_into(sock: socket.socket, cipher: LinkCipher, record: bytearray, out: memoryview | None,
                      progress: Callable[[], None], size: int = 0) -> None:
    """A sealed payload record by record, each opened into its place in `out` as it lands (`out` None:
    `size` bytes opened into a sink and dropped); a small payload's one record is already in `record`
    (it came with the tag)."""
    total = len(out) if out is not None else size
    sink = memoryview(bytearray(min(total, CHUNK))) if out is None else None
    for start in range(0, total, CHUNK):
        n = min(CHUNK, total - start)
        piece = out[start : start + n] if out is not None else sink[:n]  # type: ignore[index]
        sealed = memoryview(record)[: n + GCM_TAG]
        if start or total > SMALL_FRAME_BYTES:  # (a small one's only record came with its tag)
            _recv_exactly_into(sock, [sealed], progress)
        cipher.open_record(sealed, piece)



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
                self._accept_failed(exc)
                time.sleep(0.2)  # EMFILE and the like: the backlog waits, the loop lives
                continue
            except Exception as exc:  # never dies, whatever happens
                self._accept_failed(exc)
                continue
            self._accept_recovered()
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
            self._accept(sock, origin)
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

    def _receive_frames(self, j: int, link: Any, cipher: LinkCipher | None) -> None:
        sock: socket.socket = link
        header = bytearray(FRAME.size)

        def progress() -> None:
            self._heard(j)

        if cipher is not None:
            self._receive_sealed(j, sock, cipher, progress)
            return
        while True:
            _recv_exactly(sock, memoryview(header))
            self._heard(j)
            kind, tag_len, size = unpack_frame(bytes(header))
            tag = bytearray(tag_len)
            big = size > MAX_DISCARDED_BYTES
            if big:  # judged by its tag before room is made for it (too big to be read only to be dropped)
                _recv_exactly(sock, memoryview(tag))
                self._admit(j, kind, tag.decode(), size)  # takes it, or refuses (drops the link)
            if kind == DATA:  # control frames never wait: an abort may be what frees room
                self._reserve(j, size)
            payload = self._payload_buffer(size)
            views = ([] if big else [memoryview(tag)]) + [memoryview(payload.numpy())]  # type: ignore[arg-type]
            _recv_exactly_into(sock, views, progress)  # a small one: tag and payload in one call
            text = tag.decode()
            self._received(j, kind, text, payload, True if big else self._admit(j, kind, text, size))
            del payload  # the block goes back to the pool as soon as its reader drops it

    def _receive_sealed(self, j: int, sock: socket.socket, cipher: LinkCipher, progress: Callable[[], None]) -> None:
        """Frames of a sealed link: the header and sealed tag are checked before any room is reserved
        for the payload or more than a small one is read (a small frame's tag and payload come in one
        call: two reads, as in clear); each record is opened into its place as it lands."""
        header = bytearray(FRAME.size)
        record = bytearray(CHUNK + GCM_TAG)
        while True:
            _recv_exactly(sock, memoryview(header))
            self._heard(j)
            kind, tag_len, size = unpack_frame(bytes(header))
            sealed_tag = bytearray(tag_len + GCM_TAG)
            # a small payload (one record) comes with the tag in one read; a bigger one after the tag's check
            first = memoryview(record)[: size + GCM_TAG] if 0 < size <= SMALL_FRAME_BYTES else memoryview(record)[:0]
            _recv_exactly_into(sock, [memoryview(sealed_tag), first], progress)
            tag = cipher.open_head(bytes(header), bytes(sealed_tag)).decode()
            keep = self._admit(j, kind, tag, size)  # before any room is reserved for it
            if kind == DATA and keep:
                self._reserve(j, size)
            if keep:
                payload = self._payload_buffer(size)
                _recv_sealed_into(sock, cipher, record, memoryview(payload.numpy()), progress)  # type: ignore[arg-type]
            else:  # opened (its records are numbered) into a sink, record by record, and dropped
                payload = torch.empty(0, dtype=torch.uint8)
                _recv_sealed_into(sock, cipher, record, None, progress, size)
            self._received(j, kind, tag, payload, keep)
            del payload  # the block goes back to the pool as soon as its reader drops it

    def _send_frame(self, link: Any, header: bytes, data: torch.Tensor) -> None:
        if data.is_cuda:
            data = data.cpu()  # tcp:// stages GPU tensors through the host
        _send_all(link, [memoryview(header), memoryview(data.numpy())])  # type: ignore[arg-type]

    def _send_sealed(self, link: Any, head: bytes, cipher: LinkCipher, data: torch.Tensor) -> None:
        if data.is_cuda:
            data = data.cpu()
        # one record sealed while the one before drains from the socket buffer; the head leaves
        # with the first record in one sendmsg
        records = cipher.seal_records(memoryview(data.numpy()))  # type: ignore[arg-type]
        first = next(records, None)
        _send_all(link, [memoryview(head)] + ([first] if first is not None else []))
        for record in records:
            _send_all(link, [record])

    def _send_control(self, link: Any, cipher: LinkCipher | None, kind: int) -> bool:
        # A full socket (the peer holds us back, or is frozen) must not hold the heartbeat thread:
        # the frame is made (sealed: numbered) only once there is room for it, and then goes whole
        poller = select.poll()
        poller.register(link, select.POLLOUT)
        if not poller.poll(0):
            return False
        link.sendall(self._control_frame(cipher, kind))
        return True
