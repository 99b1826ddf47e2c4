"""A peer that sends what no honest peer sends (tests/security/test_peer_abuse.py, in one process): every
malformed frame drops that link only, naming the peer with the Python transport's words, before anything
the frame announces is allocated; the engine goes on serving its other links."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.native.support import DATA, MiB, down_reason, engines, link, raw_peer
from zend.transport.frames import ABORT, FRAME, HEARTBEAT
from zend.transport.framing import Frames

pytestmark = pytest.mark.inprocess


def _header(magic: bytes = b"ZENT", version: int = 1, kind: int = DATA, tag_len: int = 0, size: int = 0) -> bytes:
    return FRAME.pack(magic, version, kind, tag_len, size)


def _notice(code: str, reason: str) -> bytes:
    return json.dumps({"code": code, "reason": reason}).encode()


CLEAR_CASES = [
    (_header(magic=b"ZENX"), "rank 2 sent a malformed frame (magic b'ZENX', version 1, type 1, tag of 0 bytes)"),
    (_header(version=2), "rank 2 sent a malformed frame (magic b'ZENT', version 2, type 1, tag of 0 bytes)"),
    (_header(kind=9), "rank 2 sent a malformed frame (magic b'ZENT', version 1, type 9, tag of 0 bytes)"),
    (_header(tag_len=237), "rank 2 sent a malformed frame (magic b'ZENT', version 1, type 1, tag of 237 bytes)"),
    (_header(kind=HEARTBEAT, size=1), "rank 2 sent a malformed control frame (type 3, tag of 0 bytes, 1 bytes)"),
    (_header(kind=ABORT, tag_len=2, size=4097),
     "rank 2 sent a malformed control frame (type 4, tag of 2 bytes, 4097 bytes)"),
    (_header(tag_len=1, size=1 << 62) + b"t",
     f"rank 2 announced a message of {1 << 62} bytes, over the {1 << 30}-byte limit"),
    (_header(tag_len=2) + b"\xff\xfe", "rank 2 disconnected: its frame's tag is not UTF-8"),
    (_header(kind=ABORT, tag_len=4, size=5) + b"a/b/" + b"{nope",
     "rank 2 sent a malformed abort for 'a/b/'"),
    (_header(kind=ABORT, tag_len=4, size=len(_notice("lower", "x"))) + b"a/b/" + _notice("lower", "x"),
     "rank 2 sent a malformed abort (prefix 'a/b/', code 'lower')"),
    (_header(kind=ABORT, tag_len=1, size=len(_notice("CODE", "x"))) + b"/" + _notice("CODE", "x"),
     "rank 2 sent a malformed abort (prefix '/', code 'CODE')"),
]


@pytest.mark.parametrize(("frame", "reason"), CLEAR_CASES, ids=[str(i) for i in range(len(CLEAR_CASES))])
def test_a_malformed_frame_drops_only_its_link(frame: bytes, reason: str) -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        hostile = raw_peer(a, 2, sealed=False)
        hostile.send_raw(frame)
        assert down_reason(a, 2) == reason
        assert hostile.closed_by_engine()
        b.send(0, "still", b"served")
        assert bytes(memoryview(a.recv(1, "still", 5.0))) == b"served"
        a.send(1, "back", b"too")
        assert bytes(memoryview(b.recv(0, "back", 5.0))) == b"too"


def test_a_sealed_hostile_peer_with_the_keys_is_judged_the_same() -> None:
    with engines(1) as (a,):
        hostile = raw_peer(a, 2, sealed=True)
        hostile.send(ABORT, "x/", b"not json")
        assert down_reason(a, 2) == "rank 2 sent a malformed abort for 'x/'"


def test_half_a_frame_then_eof_is_a_disconnection() -> None:
    with engines(1) as (a,):
        hostile = raw_peer(a, 2, sealed=False)
        hostile.send_raw(_header(tag_len=1, size=MiB) + b"t" + b"x" * 1000)
        hostile.sock.close()
        assert down_reason(a, 2) == "rank 2 disconnected: connection closed by peer"
        assert a.buffered() == 0


def test_a_huge_announcement_allocates_nothing_before_its_bytes_are_checked() -> None:
    with engines(1, max_message_bytes=1 << 40) as (a,):  # allowed size, but the tag is forged
        hostile = raw_peer(a, 2, sealed=True)
        hostile.send_raw(_header(tag_len=1, size=1 << 39) + bytes(17))
        assert "failed authentication" in down_reason(a, 2)


def test_garbage_of_every_length_never_crashes() -> None:
    with engines(1) as (a,):
        for n, garbage in enumerate([b"\x00", b"ZENT", bytes(range(256)) * 40, struct.pack("<Q", 2**64 - 1) * 9]):
            hostile = raw_peer(a, 2, sealed=n % 2 == 1)
            hostile.send_raw(garbage)
            hostile.sock.close()
            down_reason(a, 2)
        assert a.stats()["links_dropped"] == 4


def _valid_stream(frames: Frames) -> bytes:
    out = bytearray()
    for kind, tag, payload in [(DATA, "job/1/2/0/reduce/0", b"x" * 300), (HEARTBEAT, "", b""),
                               (ABORT, "job/1/2/0/", _notice("ABORTED", "r")), (DATA, "t", b"")]:
        out += frames.head(kind, tag, len(payload)) + b"".join(bytes(p) for p in frames.pieces(memoryview(payload)))
    return bytes(out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sealed=st.booleans(), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=4),
       cut=st.integers(0, 10_000), junk=st.binary(max_size=64))
def test_mutated_streams_drop_the_link_or_pass_never_crash(sealed: bool, flips: list[tuple[int, int]], cut: int,
                                                           junk: bytes) -> None:
    with engines(1, world_size=3, max_message_bytes=1 << 20) as (a,):
        hostile = raw_peer(a, 2, sealed)
        stream = bytearray(_valid_stream(hostile.frames))
        for at, bits in flips:
            stream[at % len(stream)] ^= bits
        hostile.send_raw(bytes(stream[: cut % (len(stream) + 1)]) + junk)
        hostile.sock.close()
        reason = down_reason(a, 2)
        assert reason.startswith("rank 2 "), reason
        assert a.buffered() <= 300
