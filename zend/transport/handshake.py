"""Authenticating a data-plane connection before anything else crosses it.

Challenge-response with HMAC-SHA256 over a shared cluster secret, both ways: the connecting
rank proves it knows the secret, and so does the accepting one. Both also agree on the
protocol version, cluster id, world size and membership generation; a mismatch is refused
with an error that names the field. Messages are JSON (never pickle).
The functions here are pure; tcp.py does the socket I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import asdict, dataclass

PROTOCOL_VERSION = 1
SECRET_ENV = "ZEN_CLUSTER_SECRET"
SECRET_FILE_ENV = "ZEN_CLUSTER_SECRET_FILE"
MAX_HANDSHAKE_BYTES = 4096


class HandshakeError(ConnectionError):
    """The other side was refused, or refused us; the message says which field and why."""


@dataclass(frozen=True)
class Identity:
    """What each side of a connection claims, and what must match."""

    protocol: int
    cluster: str
    world_size: int
    generation: int
    rank: int


def load_secret(path: str | None = None) -> bytes:
    """The cluster secret: from `path`, else $ZEN_CLUSTER_SECRET_FILE, else $ZEN_CLUSTER_SECRET.

    Never from the command line (it would show in `ps`).
    """
    path = path or os.environ.get(SECRET_FILE_ENV)
    if path:
        with open(path, "rb") as f:
            secret = f.read().strip()
        source = f"file {path}"
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
        source = f"${SECRET_ENV}"
    if len(secret) < 16:
        raise HandshakeError(f"cluster secret from {source} is {len(secret)} bytes; at least 16 are required")
    return secret


def new_nonce() -> str:
    return secrets.token_hex(16)


def mismatch(mine: Identity, theirs: Identity) -> str | None:
    """The first field that differs between two sides of one cluster, as a sentence."""
    for name, label in (("protocol", "protocol version"), ("cluster", "cluster id"),
                        ("world_size", "world size"), ("generation", "membership generation")):
        a, b = getattr(theirs, name), getattr(mine, name)
        if a != b:
            return f"{label} {a!r} != {b!r}"
    if not 0 <= theirs.rank < mine.world_size:
        return f"rank {theirs.rank} outside world size {mine.world_size}"
    if theirs.rank == mine.rank:
        return f"rank {theirs.rank} is this node's own rank"
    return None


def proof(secret: bytes, role: str, own_nonce: str, peer_nonce: str, who: Identity) -> str:
    """HMAC binding the secret to both nonces and the sender's identity (role separates directions)."""
    material = json.dumps([role, own_nonce, peer_nonce, asdict(who)], sort_keys=True).encode()
    return hmac.new(secret, material, hashlib.sha256).hexdigest()


def verify(secret: bytes, role: str, sender_nonce: str, receiver_nonce: str, who: Identity, mac: str) -> bool:
    return hmac.compare_digest(proof(secret, role, sender_nonce, receiver_nonce, who), mac)


def dump(message: dict[str, object]) -> bytes:
    """A handshake message as bytes (each backend delimits it its own way)."""
    body = json.dumps(message).encode()
    if len(body) > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake message of {len(body)} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    return body


def parse(body: bytes) -> dict[str, object]:
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandshakeError(f"handshake message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise HandshakeError("handshake message is not a JSON object")
    return message


def identity_of(message: dict[str, object]) -> Identity:
    try:
        fields = message["identity"]
        assert isinstance(fields, dict)
        return Identity(int(fields["protocol"]), str(fields["cluster"]), int(fields["world_size"]),
                        int(fields["generation"]), int(fields["rank"]))
    except (KeyError, TypeError, ValueError, AssertionError):
        raise HandshakeError(f"handshake message lacks a valid identity: {message!r:.200}") from None
