"""The native engine against the pure-Python transport's framing (framing.py, sealing.py) with the same
keys, both directions, clear and sealed: the wire is byte-identical, and a forged frame drops the link
with the Python transport's words."""

from __future__ import annotations

import json
import os

import pytest

from tests.native.support import DATA, MiB, down_reason, engines, raw_peer
from zend.transport.frames import ABORT, FRAME, GOODBYE, HEARTBEAT, pack_frame

pytestmark = pytest.mark.inprocess


@pytest.mark.parametrize("tcp", [False, True], ids=["socketpair", "tcp"])
@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_python_frames_to_engine_and_back(sealed: bool, tcp: bool) -> None:
    with engines(1) as (e,):
        py = raw_peer(e, 1, sealed, tcp)
        for size in (0, 1, 100, MiB - 1, MiB, 2 * MiB + 7):
            data = os.urandom(size)
            py.send(DATA, f"in/{size}", data)
            assert bytes(memoryview(e.recv(1, f"in/{size}", 10.0))) == data
            e.send(1, f"out/{size}", data)
            assert py.read_data() == (f"out/{size}", data)
        py.send(HEARTBEAT, "")
        e.abort("job/1/2/3/", "ABORTED", "told in JSON")
        kind, tag, body = py.read()
        while kind == HEARTBEAT:
            kind, tag, body = py.read()
        assert (kind, tag, body) == (ABORT, "job/1/2/3/", b'{"code": "ABORTED", "reason": "told in JSON"}')
        py.send(GOODBYE, "")
        assert down_reason(e, 1) == "rank 1 disconnected: closed by the peer"


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_an_abort_from_python_voids_here(sealed: bool) -> None:
    with engines(1) as (e,):
        py = raw_peer(e, 1, sealed)
        py.send(ABORT, "job/7/1/0/", json.dumps({"code": "PEER_FAILED", "reason": "é \u2028 😀"}).encode())
        py.send(DATA, "after", b"ok")
        assert bytes(memoryview(e.recv(1, "after", 10.0))) == b"ok"
        assert e.voided("job/7/1/0/a/0") == ("PEER_FAILED", "é \u2028 😀")


def test_tampered_replayed_and_reordered_sealed_frames_drop_the_link() -> None:
    with engines(1) as (e,):
        py = raw_peer(e, 1, sealed=True)
        head = py.frames.head(DATA, "t", 4)
        tampered = bytearray(head)
        tampered[FRAME.size] ^= 1
        py.send_raw(bytes(tampered))
        assert down_reason(e, 1) == ("rank 1 sent a frame that failed authentication (tampered, replayed, "
                                     "reordered or not from this link's peer)")

        py = raw_peer(e, 1, sealed=True)  # a forged size in the clear header fails the same way
        forged = bytearray(py.frames.head(DATA, "t", 4))
        forged[12] = 5
        py.send_raw(bytes(forged))
        assert "failed authentication" in down_reason(e, 1)

        py = raw_peer(e, 1, sealed=True)  # a replayed frame: its numbers are spent
        frame = py.frames.head(DATA, "t", 0)
        py.send_raw(frame)
        py.send_raw(frame)
        assert "sent a frame that failed authentication" in down_reason(e, 1)

        py = raw_peer(e, 1, sealed=True)  # a payload record tampered
        data = os.urandom(3 * MiB)
        wire = py.frames.head(DATA, "big", len(data)) + b"".join(bytes(p) for p in py.frames.pieces(memoryview(data)))
        broken = bytearray(wire)
        broken[-100] ^= 0x80
        py.send_raw(bytes(broken))
        assert down_reason(e, 1) == "rank 1 sent a payload that failed authentication (tampered, replayed or reordered)"
        assert e.buffered() == 0


def test_a_clear_peer_on_a_sealed_link_is_refused() -> None:
    with engines(1) as (e,):
        py = raw_peer(e, 1, sealed=True)
        py.send_raw(pack_frame("t", 3) + b"abc" + bytes(16))
        assert "failed authentication" in down_reason(e, 1)
