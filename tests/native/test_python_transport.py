"""The native engine as rank 1 against the pure-Python tcp:// transport as rank 0, in one process: a real
handshake (handshake.py) on a loopback socket, then the engine takes the socket over with the keys the
handshake agreed. Messages both ways, aborts both ways, goodbye: the two data planes interoperate."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import pytest
import torch

from tests.native.support import MiB, engine, native
from zend.core.comm import CommAborted, CommError
from zend.transport import handshake as hs
from zend.transport.sealing import LinkCipher, derive_keys
from zend.transport.tcp import TcpTransport

pytestmark = pytest.mark.inprocess
SECRET = b"native-interop-secret-0123456789"


def _dial(address: tuple[str, int], security: str, monkeypatch: pytest.MonkeyPatch) -> tuple[socket.socket, Any, Any]:
    """Rank 1's side of a handshake with rank 0: the socket and this side's (send, recv) keys."""
    keys: dict[bool, tuple[bytes, bytes]] = {}
    for_side = LinkCipher.for_side

    def spy(secret: bytes, transcript: bytes, dialer: bool) -> LinkCipher:
        keys[dialer] = derive_keys(secret, transcript)
        return for_side(secret, transcript, dialer)

    monkeypatch.setattr(LinkCipher, "for_side", spy)
    sock = socket.create_connection(address, timeout=10)

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                raise ConnectionError("closed")
            data += more
        return data

    def send(message: hs.Message) -> None:
        body = hs.dump(message)
        sock.sendall(struct.pack("<I", len(body)) + body)

    def recv() -> hs.Message:
        return hs.parse(exactly(struct.unpack("<I", exactly(4))[0]))

    me = hs.Identity(hs.PROTOCOL_VERSION, "zen", 2, 0, 1, security)
    hs.connect_side(send, recv, me, SECRET, 0)
    if security == "none":
        return sock, None, None
    out, back = keys[True]  # dialer -> acceptor, acceptor -> dialer
    return sock, out, back


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("security", ["aead", "none"])
def test_engine_and_python_tcp_transport_interoperate(security: str, monkeypatch: pytest.MonkeyPatch) -> None:
    python_side = TcpTransport(0, 2, cluster_id="zen", secret=SECRET, timeout_s=10.0, security=security).start()
    e = engine(1, 2)
    try:
        sock, send_key, recv_key = _dial(python_side.address, security, monkeypatch)
        e.attach(0, sock.fileno(), send_key, recv_key)
        sock.close()
        python_side.wait_connected(1, 10.0)
        for size in (0, 1, 4096, MiB + 3):
            data = os.urandom(size)
            python_side.send(1, f"to/{size}", _tensor(data))
            assert bytes(memoryview(e.recv(0, f"to/{size}", 10.0))) == data
            e.send(0, f"from/{size}", data)
            assert bytes(python_side.recv(1, f"from/{size}", 10.0).numpy()) == data

        e.abort("job/1/2/0/", "PEER_FAILED", "rank 1 says so")
        with pytest.raises(CommAborted, match="rank 1 says so"):
            python_side.recv(1, "job/1/2/0/reduce/0", 10.0)
        python_side.abort("job/1/3/0/", "rank 0 says so", "ABORTED")
        with pytest.raises(native.Aborted, match="rank 0 says so"):
            e.recv(0, "job/1/3/0/reduce/0", 10.0)

        e.close()
        with pytest.raises(CommError, match="rank 1"):
            python_side.recv(1, "after", 10.0)
    finally:
        e.close()
        python_side.close()
