"""How a frame looks on a link: in clear, or sealed (one wrapper over the same frames, for every backend).

A frame is its header, its tag and its payload (frames.py). `Frames` puts them on the wire as they are;
`SealedFrames` wraps the same calls with a link's AES-GCM keys (sealing.py): the tag sealed as one
record that authenticates the header too, the payload sealed in records of up to CHUNK bytes. A backend
(tcp.py, ucx.py) moves bytes and asks its link's `Frames` what to send and how to open what came: it
never writes a clear and a sealed path of its own. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

from zend.transport.frames import FRAME, pack_frame
from zend.transport.sealing import GCM_TAG, LinkCipher, sealed_size


class Frames:
    """Frames in clear (data-plane security "none")."""

    sealed = False
    tag_overhead = 0  # bytes the tag takes on the wire beyond its own

    def head(self, kind: int, tag: str, size: int) -> bytes:
        """Header and tag, as they go on the wire (for a control frame, the whole frame)."""
        return pack_frame(tag, size, kind)

    def open_head(self, header: bytes, tag_on_wire: bytes) -> str:
        """The tag of a frame whose header and tag arrived (sealed: FrameError if either was forged)."""
        return tag_on_wire.decode()

    def wire_size(self, size: int) -> int:
        """Bytes a payload of `size` takes on the wire."""
        return size

    def pieces(self, payload: memoryview) -> Iterator[memoryview]:
        """The payload as it goes on the wire, piece by piece (send each before asking for the next)."""
        if len(payload):
            yield payload

    def open_piece(self, on_wire: memoryview, out: memoryview) -> None:
        """One piece as it came (len(out) + overhead bytes) into its place in the payload."""
        out[:] = on_wire

    def seal_all(self, payload: memoryview, out: memoryview) -> None:
        """The whole payload onto the wire at once, into `out` (wire_size bytes), for a message-based backend."""
        out[:] = payload

    def open_all(self, on_wire: memoryview, out: memoryview) -> None:
        out[:] = on_wire

    @property
    def lands_in_place(self) -> bool:
        """Whether a payload can be received straight into its place (in clear: no opening needed)."""
        return not self.sealed


class SealedFrames(Frames):
    """Frames sealed with one link's keys (data-plane security "aead"). Not thread-safe: the link's send
    lock orders its sends, its one receiver its receives (records are numbered in each direction)."""

    sealed = True
    tag_overhead = GCM_TAG

    def __init__(self, cipher: LinkCipher):
        self.cipher = cipher

    def head(self, kind: int, tag: str, size: int) -> bytes:
        frame = pack_frame(tag, size, kind)
        return self.cipher.seal_head(frame[: FRAME.size], frame[FRAME.size:])

    def open_head(self, header: bytes, tag_on_wire: bytes) -> str:
        return self.cipher.open_head(header, tag_on_wire).decode()

    def wire_size(self, size: int) -> int:
        return sealed_size(size)

    def pieces(self, payload: memoryview) -> Iterator[memoryview]:
        return self.cipher.seal_records(payload)

    def open_piece(self, on_wire: memoryview, out: memoryview) -> None:
        self.cipher.open_record(on_wire, out)

    def seal_all(self, payload: memoryview, out: memoryview) -> None:
        self.cipher.seal_all(payload, out)

    def open_all(self, on_wire: memoryview, out: memoryview) -> None:
        self.cipher.open_all(on_wire, out)


def frames_for(cipher: LinkCipher | None) -> Frames:
    """A link's frames: sealed with its keys, or in clear when it has none (security "none")."""
    return Frames() if cipher is None else SealedFrames(cipher)
