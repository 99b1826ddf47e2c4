"""Sealed frames: after the handshake, every byte between two daemons is authenticated and encrypted.

Each direction of a link has its own AES-256-GCM key, derived in the handshake from the
cluster secret and both sides' nonces (HKDF-SHA256), so a key never outlives its link. A frame
travels as
- its 20-byte header in clear (the receiver needs the sizes), authenticated as the associated
  data of
- the tag, sealed as one record (tag + 16-byte GCM tag), checked before anything else of the
  frame is read or any room is reserved for it: a forged size is refused before it allocates;
- the payload, sealed in records of up to CHUNK bytes each, so a sender encrypts one record
  while the previous one drains and a receiver decrypts one while the next one arrives.
The nonce of a record is its sequence number in that direction (never sent): a record replayed,
dropped, reordered or taken from another link fails authentication, and the link is dropped.
AES-GCM from `cryptography` (OpenSSL): 9-15 GB/s per core with AES-NI/VAES here, against
3-4 GB/s for ChaCha20-Poly1305 (measured with encrypt_into on this machine).
Pure code: no I/O; the backends move the bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from zend.transport.frames import FrameError

GCM_TAG = 16
CHUNK = 1 << 20  # payload bytes per sealed record
SECURITY_MODES = ("aead", "none")
_NONCE = struct.Struct("<4xQ")  # 12 bytes: the record's sequence number in this direction
_KEY_INFO = b"zen data plane: frame keys, dialer->acceptor then acceptor->dialer"


def derive_keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(dialer->acceptor key, acceptor->dialer key) for the link whose handshake said `transcript`."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=hashlib.sha256(transcript).digest(),
               info=_KEY_INFO).derive(secret)
    return okm[:32], okm[32:]


def sealed_size(size: int) -> int:
    """Bytes a payload of `size` takes on the wire once sealed (a GCM tag per record)."""
    return size + GCM_TAG * -(-size // CHUNK)


class LinkCipher:
    """One link's two directions. Not thread-safe: the link's send lock orders the sends, its one
    receiving thread the receives."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        self.keys = (send_key, recv_key)  # what a native engine taking the link over seals and opens with
        self._send, self._recv = AESGCM(send_key), AESGCM(recv_key)
        self._send_seq = self._recv_seq = 0
        self._scratch = bytearray(CHUNK + GCM_TAG)

    @classmethod
    def for_side(cls, secret: bytes, transcript: bytes, dialer: bool) -> LinkCipher:
        out, back = derive_keys(secret, transcript)
        return cls(out, back) if dialer else cls(back, out)

    def _next_send(self) -> bytes:
        nonce = _NONCE.pack(self._send_seq)
        self._send_seq += 1
        return nonce

    def _next_recv(self) -> bytes:
        nonce = _NONCE.pack(self._recv_seq)
        self._recv_seq += 1
        return nonce

    # ------------------------------------------------------------------ sending
    def seal_head(self, header: bytes, tag: bytes) -> bytes:
        """The clear header followed by the sealed tag (which authenticates the header too)."""
        return header + self._send.encrypt(self._next_send(), tag, header)

    def seal_records(self, payload: memoryview) -> Iterator[memoryview]:
        """The payload's sealed records, one at a time in a reused buffer: send each before the next."""
        for start in range(0, len(payload), CHUNK):
            piece = payload[start : start + CHUNK]
            out = memoryview(self._scratch)[: len(piece) + GCM_TAG]
            self._send.encrypt_into(self._next_send(), piece, None, out)
            yield out

    def seal_all(self, payload: memoryview, out: memoryview) -> None:
        """Every record of the payload into `out` (sealed_size bytes), for a backend that sends whole messages."""
        pos = 0
        for start in range(0, len(payload), CHUNK):
            piece = payload[start : start + CHUNK]
            self._send.encrypt_into(self._next_send(), piece, None, out[pos : pos + len(piece) + GCM_TAG])
            pos += len(piece) + GCM_TAG

    # ------------------------------------------------------------------ receiving
    def open_head(self, header: bytes, sealed_tag: bytes) -> bytes:
        """The tag of a frame whose header and sealed tag arrived; FrameError if either was forged."""
        try:
            return self._recv.decrypt(self._next_recv(), sealed_tag, header)
        except InvalidTag:
            raise FrameError("sent a frame that failed authentication (tampered, replayed, reordered "
                             "or not from this link's peer)") from None

    def open_record(self, sealed: memoryview, out: memoryview) -> None:
        """One payload record (len(out) + GCM_TAG bytes) into `out`."""
        try:
            self._recv.decrypt_into(self._next_recv(), sealed, None, out)
        except InvalidTag:
            raise FrameError("sent a payload that failed authentication (tampered, replayed or "
                             "reordered)") from None

    def open_all(self, sealed: memoryview, out: memoryview) -> None:
        """Every record of a whole sealed payload (sealed_size(len(out)) bytes) into `out`."""
        pos = 0
        for start in range(0, len(out), CHUNK):
            piece = out[start : start + CHUNK]
            self.open_record(sealed[pos : pos + len(piece) + GCM_TAG], piece)
            pos += len(piece) + GCM_TAG
