"""The framing wrapper (zend/transport/framing.py) on its own: a frame put on the wire by one side's
`Frames` comes back whole through the other side's, in clear and sealed, by pieces (a stream backend:
tcp://) and all at once (a message backend: ucx://); a sealed frame whose header, tag or payload was
touched, or that came twice, fails. Over real links, both backends: test_conformance.py and
test_sealed_links.py."""

from __future__ import annotations

import os

import pytest

from zend.transport.frames import ABORT, DATA, FRAME, HEARTBEAT, FrameError, unpack_frame
from zend.transport.framing import Frames, SealedFrames, frames_for
from zend.transport.sealing import CHUNK, GCM_TAG, LinkCipher

pytestmark = pytest.mark.inprocess


def _pair(sealed: bool) -> tuple[Frames, Frames]:
    if not sealed:
        return frames_for(None), frames_for(None)
    out, back = os.urandom(32), os.urandom(32)
    return frames_for(LinkCipher(out, back)), frames_for(LinkCipher(back, out))


def _by_pieces(sender: Frames, receiver: Frames, kind: int, tag: str, payload: bytes) -> tuple[int, str, bytes]:
    """As tcp:// does: the head, then the payload piece by piece, each opened into its place."""
    wire = sender.head(kind, tag, len(payload)) + b"".join(bytes(p) for p in sender.pieces(memoryview(payload)))
    got_kind, tag_len, size = unpack_frame(wire[: FRAME.size])
    at = FRAME.size + tag_len + receiver.tag_overhead
    got_tag = receiver.open_head(wire[: FRAME.size], wire[FRAME.size : at])
    out = bytearray(size)
    for start in range(0, size, CHUNK):
        n = min(CHUNK, size - start)
        receiver.open_piece(memoryview(wire)[at : at + n + receiver.tag_overhead], memoryview(out)[start : start + n])
        at += n + receiver.tag_overhead
    assert at == len(wire)
    return got_kind, got_tag, bytes(out)


def _all_at_once(sender: Frames, receiver: Frames, tag: str, payload: bytes) -> tuple[str, bytes]:
    """As ucx:// does: the head as one message, the payload sealed whole as another."""
    head = sender.head(DATA, tag, len(payload))
    wire = bytearray(sender.wire_size(len(payload)))
    sender.seal_all(memoryview(payload), memoryview(wire))
    tag_len = unpack_frame(head[: FRAME.size])[1]
    got_tag = receiver.open_head(head[: FRAME.size], head[FRAME.size : FRAME.size + tag_len + receiver.tag_overhead])
    out = bytearray(len(payload))
    receiver.open_all(memoryview(wire), memoryview(out))
    return got_tag, bytes(out)


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 7])
def test_a_frame_comes_back_whole_either_way(sealed: bool, size: int) -> None:
    sender, receiver = _pair(sealed)
    payload = os.urandom(size)
    assert _by_pieces(sender, receiver, DATA, "job/t/3/0/push", payload) == (DATA, "job/t/3/0/push", payload)
    assert _all_at_once(sender, receiver, "job/t/4/0/pull", payload) == ("job/t/4/0/pull", payload)
    assert sender.wire_size(size) == size + (GCM_TAG * -(-size // CHUNK) if sealed else 0)
    # a control frame is its head alone, and the next frame still opens (the numbering kept step)
    control = sender.head(HEARTBEAT, "", 0)
    assert receiver.open_head(control[: FRAME.size], control[FRAME.size :]) == ""
    assert _by_pieces(sender, receiver, ABORT, "job/t/5/", b"{}") == (ABORT, "job/t/5/", b"{}")


def test_clear_frames_land_in_place_and_sealed_ones_do_not() -> None:
    clear, sealed = _pair(False)[0], _pair(True)[0]
    assert clear.lands_in_place and not clear.sealed and clear.tag_overhead == 0
    assert isinstance(sealed, SealedFrames) and not sealed.lands_in_place and sealed.tag_overhead == GCM_TAG


@pytest.mark.parametrize("where", ["header", "tag", "payload"])
def test_a_sealed_frame_touched_anywhere_fails(where: str) -> None:
    sender, receiver = _pair(True)
    payload = os.urandom(1000)
    wire = bytearray(sender.head(DATA, "job/t/1/0/push", len(payload)))
    tag_end = len(wire)
    wire += b"".join(bytes(p) for p in sender.pieces(memoryview(payload)))
    flip = {"header": 16, "tag": FRAME.size + 2, "payload": tag_end + 5}[where]
    wire[flip] ^= 1
    with pytest.raises(FrameError, match="failed authentication"):
        receiver.open_head(bytes(wire[: FRAME.size]), bytes(wire[FRAME.size : tag_end]))
        receiver.open_piece(memoryview(wire)[tag_end:], memoryview(bytearray(len(payload))))


def test_a_sealed_frame_replayed_fails() -> None:
    sender, receiver = _pair(True)
    head = sender.head(DATA, "job/t/1/0/push", 0)
    receiver.open_head(head[: FRAME.size], head[FRAME.size :])
    with pytest.raises(FrameError, match="failed authentication"):
        receiver.open_head(head[: FRAME.size], head[FRAME.size :])


def test_frames_in_clear_are_what_frames_py_packs() -> None:
    clear = frames_for(None)
    head = clear.head(DATA, "a/b", 12)
    assert unpack_frame(head[: FRAME.size]) == (DATA, 3, 12) and head[FRAME.size :] == b"a/b"
    assert clear.open_head(head[: FRAME.size], head[FRAME.size :]) == "a/b"
