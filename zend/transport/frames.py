"""The frame every data-plane message travels in, on any link transport (tcp://, ucx://).

A frame is a 20-byte header (magic, version, type, tag length, payload length), the tag,
then the payload. Besides data frames, three control frames share the link:
- goodbye (sent by close, no tag, no payload): the peer fails its pending receives at once;
- heartbeat (no tag, no payload): sent on a link that has been quiet, so the peer can tell a
  silent-but-alive link from a frozen host or a cut cable (link_transport.py);
- abort (tag: a tag prefix, payload: a short JSON reason): every message under that prefix is
  void, on both sides (a failed step, `Communicator.abort`).
Anything else that does not parse is a FrameError: the link that sent it is dropped.
"""

from __future__ import annotations

import struct

from zend.core.comm import CommError

FRAME = struct.Struct("<4sBBxxIQ")  # magic, version, type, tag length, payload length
MAGIC = b"ZENT"
FRAME_VERSION = 1
DATA = 1
GOODBYE = 2  # sent by close(): the peer fails its pending receives at once, on any backend
HEARTBEAT = 3
ABORT = 4
KINDS = (DATA, GOODBYE, HEARTBEAT, ABORT)
MAX_ABORT_BYTES = 4096  # an abort's reason is a sentence, not data
MAX_TAG_BYTES = 236  # a frame header (20 bytes + tag) fits 256 bytes


class FrameError(ValueError):
    """A malformed frame: the link that sent it is dropped, others are untouched."""


def pack_frame(tag: str, size: int, kind: int = DATA) -> bytes:
    tag_bytes = tag.encode()
    if len(tag_bytes) > MAX_TAG_BYTES:
        raise CommError(f"tag {tag[:40]!r}... of {len(tag_bytes)} bytes exceeds {MAX_TAG_BYTES}")
    return FRAME.pack(MAGIC, FRAME_VERSION, kind, len(tag_bytes), size) + tag_bytes


def unpack_frame(header: bytes) -> tuple[int, int, int]:
    """(kind, tag length, payload size) of a frame header, checked before anything it announces is
    read (on a sealed link the header is authenticated with the tag, before the payload)."""
    magic, version, kind, tag_len, size = FRAME.unpack(header[: FRAME.size])
    if magic != MAGIC or version != FRAME_VERSION or kind not in KINDS or tag_len > MAX_TAG_BYTES:
        raise FrameError(f"sent a malformed frame (magic {magic!r}, version {version}, type {kind}, "
                         f"tag of {tag_len} bytes)")
    if (kind in (HEARTBEAT, GOODBYE) and (tag_len or size)) or (kind == ABORT and size > MAX_ABORT_BYTES):
        raise FrameError(f"sent a malformed control frame (type {kind}, tag of {tag_len} bytes, {size} bytes)")
    return kind, tag_len, size
