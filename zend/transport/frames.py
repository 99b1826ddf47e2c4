"""The frame every data-plane message travels in, on any link transport (tcp://, ucx://).

A frame is a 20-byte header (magic, version, type, tag length, payload length), the tag,
then the payload. A goodbye frame (sent by close) tells the peer to fail its pending receives
at once. Anything else that does not parse is a FrameError: the link that sent it is dropped.
"""

from __future__ import annotations

import struct

from zend.core.comm import CommError

FRAME = struct.Struct("<4sBBxxIQ")  # magic, version, type, tag length, payload length
MAGIC = b"ZENT"
FRAME_VERSION = 1
DATA = 1
GOODBYE = 2  # sent by close(): the peer fails its pending receives at once, on any backend
MAX_TAG_BYTES = 236  # a frame header (20 bytes + tag) fits 256 bytes


class FrameError(ValueError):
    """A malformed frame: the link that sent it is dropped, others are untouched."""


def pack_frame(tag: str, size: int, kind: int = DATA) -> bytes:
    tag_bytes = tag.encode()
    if len(tag_bytes) > MAX_TAG_BYTES:
        raise CommError(f"tag {tag[:40]!r}... of {len(tag_bytes)} bytes exceeds {MAX_TAG_BYTES}")
    return FRAME.pack(MAGIC, FRAME_VERSION, kind, len(tag_bytes), size) + tag_bytes


def unpack_frame(header: bytes) -> tuple[int, int]:
    """(tag length, payload size) of a data frame header; ConnectionError for a goodbye."""
    magic, version, kind, tag_len, size = FRAME.unpack(header[: FRAME.size])
    if magic == MAGIC and version == FRAME_VERSION and kind == GOODBYE:
        raise ConnectionError("closed by the peer")
    if magic != MAGIC or version != FRAME_VERSION or kind != DATA or tag_len > MAX_TAG_BYTES:
        raise FrameError(f"sent a malformed frame (magic {magic!r}, version {version}, type {kind}, "
                         f"tag of {tag_len} bytes)")
    return tag_len, size
