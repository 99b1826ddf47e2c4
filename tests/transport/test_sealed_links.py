"""Sealed frames (issue 14): what an on-path attacker without the secret can and cannot do to a link.

Pure tests of the record layer (sealing.py), then real rank processes behind a relay that lets
the handshake through and then rewrites one byte, as an on-path attacker would.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading

import pytest

from tests.transport.conftest import RemoteError
from tests.transport.worker import payload as seeded_payload
from zend.transport.frames import FRAME, FrameError, pack_frame
from zend.transport.handshake import PROTOCOL_VERSION
from zend.transport.sealing import CHUNK, GCM_TAG, LinkCipher, sealed_size

SECRET = b"test-cluster-secret-0123456789"


def _pair() -> tuple[LinkCipher, LinkCipher]:
    said = b"a transcript"
    return LinkCipher.for_side(SECRET, said, dialer=True), LinkCipher.for_side(SECRET, said, dialer=False)


def _seal(sender: LinkCipher, tag: str, data: bytes) -> tuple[bytes, bytes]:
    frame = pack_frame(tag, len(data))
    head = sender.seal_head(frame[: FRAME.size], frame[FRAME.size :])
    body = b"".join(bytes(r) for r in sender.seal_records(memoryview(data)))
    return head, body


def _open(receiver: LinkCipher, head: bytes, body: bytes, size: int) -> tuple[bytes, bytes]:
    tag = receiver.open_head(head[: FRAME.size], head[FRAME.size :])
    out = bytearray(size)
    receiver.open_all(memoryview(body), memoryview(out))
    return tag, bytes(out)


@pytest.mark.inprocess
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17])
def test_sealed_frames_open_to_what_was_sent_across_record_boundaries(size):
    dialer, acceptor = _pair()
    data = bytes(seeded_payload(size, size).numpy())
    for _ in range(3):  # sequence numbers move on in step on both sides
        head, body = _seal(dialer, "job/emb/7/0/push", data)
        assert len(body) == sealed_size(size) == size + GCM_TAG * -(-size // CHUNK)
        assert size < 64 or data[:64] not in body  # not readable in clear
        assert _open(acceptor, head, body, size) == (b"job/emb/7/0/push", data)
    head, body = _seal(acceptor, "back", data)  # the other direction has its own key and numbers
    assert _open(dialer, head, body, size)[1] == data


@pytest.mark.inprocess
@pytest.mark.parametrize("where", ["header size", "header kind", "tag", "payload", "gcm tag"])
def test_any_flipped_bit_fails_authentication(where):
    dialer, acceptor = _pair()
    head, body = _seal(dialer, "t", b"x" * 5000)
    head, body = bytearray(head), bytearray(body)
    {"header size": lambda: head.__setitem__(12, head[12] ^ 1), "header kind": lambda: head.__setitem__(5, 4),
     "tag": lambda: head.__setitem__(FRAME.size, head[FRAME.size] ^ 1),
     "payload": lambda: body.__setitem__(100, body[100] ^ 0x80),
     "gcm tag": lambda: body.__setitem__(len(body) - 1, body[-1] ^ 1)}[where]()
    with pytest.raises(FrameError, match="failed authentication"):
        _open(acceptor, bytes(head), bytes(body), 5000)


@pytest.mark.inprocess
def test_replayed_reordered_and_reflected_frames_fail_authentication():
    dialer, acceptor = _pair()
    first, second = _seal(dialer, "a", b"1" * 10), _seal(dialer, "b", b"2" * 10)
    _open(acceptor, *first, 10)
    with pytest.raises(FrameError):  # the same frame again
        _open(acceptor, *first, 10)
    dialer, acceptor = _pair()
    first, second = _seal(dialer, "a", b"1" * 10), _seal(dialer, "b", b"2" * 10)
    with pytest.raises(FrameError):  # the second before the first
        _open(acceptor, *second, 10)
    dialer, acceptor = _pair()
    with pytest.raises(FrameError):  # our own frame sent back to us
        _open(dialer, *_seal(dialer, "a", b"1" * 10), 10)
    other = LinkCipher.for_side(SECRET, b"another link", dialer=False)
    with pytest.raises(FrameError):  # a frame of another link
        _open(other, *_seal(LinkCipher.for_side(SECRET, b"a transcript", dialer=True), "a", b"1"), 1)


class Relay:
    """An on-path attacker without the secret between a dialling rank and the rank it dials: it
    forwards the handshake untouched, then flips one byte of the dialler's stream `flip_at` bytes
    after the handshake, and keeps what it saw. It takes one connection (a redial finds no one)."""

    def __init__(self, target: tuple[str, int], flip_at: int):
        self.target, self.flip_at = target, flip_at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()  # the dialler's bytes after the handshake, as they left it
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            self.listener.close()
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
            self._pump(client, server, True)

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        with contextlib.suppress(OSError):
            if tamper:
                for _ in range(2):  # the dialler's hello and proof, length-prefixed
                    length = struct.unpack("<I", self._exactly(src, 4))[0]
                    dst.sendall(struct.pack("<I", length) + self._exactly(src, length))
            while chunk := src.recv(1 << 16):
                if tamper:
                    start = len(self.seen)
                    self.seen += chunk
                    if start <= self.flip_at < start + len(chunk):
                        chunk = bytearray(chunk)
                        chunk[self.flip_at - start] ^= 0x01
                        chunk = bytes(chunk)
                dst.sendall(chunk)

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            if not more:
                raise OSError("closed")
            data += more
        return data

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.mark.daemon
@pytest.mark.parametrize("security", ["aead", "none"])
def test_an_on_path_relay_can_neither_read_nor_rewrite_a_sealed_link(processes, scheme, security):
    if not scheme.startswith("tcp"):
        pytest.skip("the relay parses tcp://'s handshake framing; ucx:// frames its own")
    good = processes.start(0, 2, security=security)
    relay = Relay(good.address, flip_at=1000)  # inside the first payload
    try:
        linking = good.start("connect", peers={"0": list(good.address), "1": ["127.0.0.1", 1]}, timeout_s=20)
        dialer = processes.start(1, 2, security=security)
        dialer.call("connect", peers={"0": ["127.0.0.1", relay.port], "1": list(dialer.address)}, timeout_s=10)
        good.wait(linking)
        dialer.call("send", dst=0, tag="grad", seeds=[11], size=1 << 16)
        clear = bytes(seeded_payload(1 << 16, 11).numpy())
        if security == "none":  # what the relay does to a link in clear: the test can fail
            assert good.call("recv", src=1, tag="grad", seeds=[11], size=1 << 16)["intact"] == [False]
            assert clear[2000:2064] in relay.seen
            return
        with pytest.raises(RemoteError, match="failed authentication") as refused:
            good.call("recv", src=1, tag="grad", seeds=[11], size=1 << 16, timeout_s=10)
        assert refused.value.kind == "CommError" and "rank 1" in str(refused.value)
        assert clear[2000:2064] not in relay.seen and len(relay.seen) > 1 << 16
    finally:
        relay.close()


@pytest.mark.daemon
def test_a_stranger_gets_no_mac_to_guess_the_secret_against(processes, scheme):
    if not scheme.startswith("tcp"):
        pytest.skip("raw tcp:// handshake framing")
    good = processes.start(0, 2)

    def message(sock: socket.socket, body: dict[str, object]) -> dict[str, object]:
        data = json.dumps(body).encode()
        sock.sendall(struct.pack("<I", len(data)) + data)
        length = struct.unpack("<I", Relay._exactly(sock, 4))[0]
        return dict(json.loads(Relay._exactly(sock, length)))

    identity = {"protocol": PROTOCOL_VERSION, "cluster": "test", "world_size": 2, "generation": 0, "rank": 1,
                "security": "aead"}
    with socket.create_connection(good.address, timeout=5) as s:
        challenge = message(s, {"type": "hello", "identity": identity, "nonce": "0" * 32})
        assert challenge["type"] == "challenge" and "mac" not in challenge, challenge
        refusal = message(s, {"type": "proof", "mac": "0" * 64})
        assert refusal == {"type": "error", "error": "authentication failed: wrong cluster secret"}
    with socket.create_connection(good.address, timeout=5) as s, pytest.raises(OSError):  # a bad nonce: cut off
        message(s, {"type": "hello", "identity": identity, "nonce": {"a": 1}})
    processes.let_in(good, seed=5, connect_timeout_s=10)


@pytest.mark.daemon
@pytest.mark.parametrize("size", [0, 1, CHUNK + 1, 16 << 20])
def test_links_in_clear_when_the_operator_says_so(processes, size):
    a, b = processes.mesh(2, security="none")
    b.call("send", dst=0, tag="clear", seeds=[size], size=size)
    assert a.call("recv", src=1, tag="clear", seeds=[size], size=size)["intact"] == [True]


@pytest.mark.inprocess
def test_handshake_messages_must_have_exactly_their_fields():
    from zend.transport import handshake as hs

    identity = {"protocol": PROTOCOL_VERSION, "cluster": "c", "world_size": 2, "generation": 0, "rank": 1,
                "security": "aead"}
    hello = {"type": "hello", "identity": identity, "nonce": "0" * 32}
    assert hs.identity_of(hs.expect(hello, "hello")).rank == 1
    with pytest.raises(hs.HandshakeError, match=r"unexpected fields \['padding'\]"):
        hs.expect({**hello, "padding": "x" * 100}, "hello")
    with pytest.raises(hs.HandshakeError, match=r"missing \['nonce'\]"):
        hs.expect({"type": "hello", "identity": identity}, "hello")
    with pytest.raises(hs.HandshakeError, match="expected a proof message, got type 'hello'"):
        hs.expect(hello, "proof")
    with pytest.raises(hs.HandshakeError, match="refused: wrong"):
        hs.expect({"type": "error", "error": "wrong"}, "challenge")
    with pytest.raises(hs.HandshakeError, match="identity fields"):
        hs.identity_of({**hello, "identity": {**identity, "admin": True}})
    with pytest.raises(hs.HandshakeError, match="security='tls'"):
        hs.identity_of({**hello, "identity": {**identity, "security": "tls"}})
