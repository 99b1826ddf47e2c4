"""Engines, links and a raw Python peer for the native engine's tests (zend/transport/native).

Importing this skips the importing module when zend._engine is not built (it is optional)."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from zend.transport.frames import DATA, FRAME, pack_frame, unpack_frame
from zend.transport.framing import Frames, frames_for
from zend.transport.sealing import LinkCipher


def _load_engine_file(path: str) -> None:
    """Loads a build of the engine from a file as zend._engine (scripts/native_build.sh --sanitize)."""
    spec = importlib.util.spec_from_file_location("zend._engine", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["zend._engine"] = module


if os.environ.get("ZEN_NATIVE_ENGINE"):
    _load_engine_file(os.environ["ZEN_NATIVE_ENGINE"])
native: Any = pytest.importorskip(
    "zend._engine",
    reason="zend._engine is not built (python setup.py build_ext --inplace needs g++ and OpenSSL headers)")

MiB = 1 << 20


def engine(rank: int, world_size: int = 3, **overrides: Any) -> Any:
    options: dict[str, Any] = dict(max_buffered_bytes=1 << 30, max_message_bytes=1 << 30, peer_timeout_s=10.0,
                                   heartbeat_s=0.5)
    options.update(overrides)
    return native.Engine(rank, world_size, **options)


@contextmanager
def engines(count: int = 2, world_size: int = 3, **overrides: Any) -> Iterator[list[Any]]:
    made = [engine(r, world_size, **overrides) for r in range(count)]
    try:
        yield made
    finally:
        for e in made:
            e.close()


def keys() -> tuple[bytes, bytes]:
    return os.urandom(32), os.urandom(32)


def socket_pair(tcp: bool) -> tuple[socket.socket, socket.socket]:
    if not tcp:
        return socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialer = socket.create_connection(listener.getsockname())
        acceptor, _ = listener.accept()
    for s in (dialer, acceptor):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return dialer, acceptor


def link(a: Any, b: Any, sealed: bool, tcp: bool = False) -> tuple[int, int]:
    """Links engines a and b (by their ranks) over a fresh socket pair; the engines own dups."""
    s1, s2 = socket_pair(tcp)
    k1, k2 = keys() if sealed else (None, None)
    try:
        return a.attach(b.rank, s1.fileno(), k1, k2), b.attach(a.rank, s2.fileno(), k2, k1)
    finally:
        s1.close()
        s2.close()


class RawPeer:
    """The Python transport's side of a link, frame by frame on a plain socket (framing.py, sealing.py)."""

    def __init__(self, sock: socket.socket, frames: Frames):
        self.sock, self.frames = sock, frames
        sock.settimeout(10)

    def send(self, kind: int, tag: str, payload: bytes = b"") -> None:
        head = self.frames.head(kind, tag, len(payload))
        self.sock.sendall(head + b"".join(bytes(p) for p in self.frames.pieces(memoryview(payload))))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionError("closed")
            out += got
        return bytes(out)

    def read(self) -> tuple[int, str, bytes]:
        header = self._exactly(FRAME.size)
        kind, tag_len, size = unpack_frame(header)
        tag = self.frames.open_head(header, self._exactly(tag_len + self.frames.tag_overhead))
        payload = bytearray(size)
        if size:
            self.frames.open_all(memoryview(self._exactly(self.frames.wire_size(size))), memoryview(payload))
        return kind, tag, bytes(payload)

    def read_data(self) -> tuple[str, bytes]:
        """The next DATA frame, skipping heartbeats."""
        while True:
            kind, tag, payload = self.read()
            if kind == DATA:
                return tag, payload

    def closed_by_engine(self, within_s: float = 5.0) -> bool:
        """Whether the engine shut the link (EOF), skipping whatever frames it sent before."""
        self.sock.settimeout(within_s)
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            return False
        return True


def raw_peer(e: Any, peer: int, sealed: bool, tcp: bool = False) -> RawPeer:
    """A raw Python peer attached to engine `e` as rank `peer`."""
    s1, s2 = socket_pair(tcp)
    k1, k2 = keys()
    e.attach(peer, s1.fileno(), k1 if sealed else None, k2 if sealed else None)
    s1.close()
    return RawPeer(s2, frames_for(LinkCipher(k2, k1) if sealed else None))


def wait_for(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {check}")
        time.sleep(0.01)


def down_reason(e: Any, peer: int, timeout_s: float = 10.0) -> str:
    """The reason of the next "down" event of `peer` on engine `e`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for what, who, _serial, detail in e.next_events(0.2):
            if what == "down" and who == peer:
                return str(detail)
    raise AssertionError(f"no down event for rank {peer} within {timeout_s} s")


__all__ = ["DATA", "MiB", "RawPeer", "down_reason", "engine", "engines", "keys", "link", "native", "pack_frame",
           "raw_peer", "socket_pair", "wait_for"]
