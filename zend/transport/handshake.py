"""Authenticating a data-plane connection before anything else crosses it: the messages and the flow.

Challenge-response with HMAC-SHA256 over a shared cluster secret, both ways: the connecting
rank proves it knows the secret, and so does the accepting one. Both also agree on the
protocol version, cluster id, world size and membership generation; a mismatch is refused
with an error that names the field. Messages are JSON (never pickle). `connect_side` and
`accept_side` run the flow over two callables that send and receive one message; each backend
supplies them (and delimits the messages its own way), so no socket is touched here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass

PROTOCOL_VERSION = 2  # 2: heartbeat and abort frames
MAX_HANDSHAKE_BYTES = 4096

Message = dict[str, object]
SendMessage = Callable[[Message], None]
RecvMessage = Callable[[], Message]


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


def dump(message: Message) -> bytes:
    """A handshake message as bytes (each backend delimits it its own way)."""
    body = json.dumps(message).encode()
    if len(body) > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake message of {len(body)} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    return body


def parse(body: bytes) -> Message:
    if len(body) > MAX_HANDSHAKE_BYTES:
        raise HandshakeError(f"handshake message of {len(body)} bytes exceeds {MAX_HANDSHAKE_BYTES}")
    try:  # an unauthenticated peer wrote it: no NaN or Infinity, no nesting deep enough to recurse out
        message = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise HandshakeError(f"handshake message is not JSON: {exc}") from None
    except RecursionError:
        raise HandshakeError("handshake message is nested too deep") from None
    if not isinstance(message, dict):
        raise HandshakeError("handshake message is not a JSON object")
    return message


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a value a handshake carries")


def _whole(fields: dict[str, object], name: str) -> int:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{name}={value!r:.40} is not a non-negative 64-bit integer")
    return value


def identity_of(message: Message) -> Identity:
    try:
        fields = message["identity"]
        if not isinstance(fields, dict) or not isinstance(fields.get("cluster"), str):
            raise TypeError("identity is not an object with a cluster id")
        return Identity(_whole(fields, "protocol"), str(fields["cluster"]), _whole(fields, "world_size"),
                        _whole(fields, "generation"), _whole(fields, "rank"))
    except (KeyError, TypeError, ValueError) as exc:
        raise HandshakeError(f"handshake message lacks a valid identity ({exc}): {message!r:.200}") from None


def connect_side(send: SendMessage, recv: RecvMessage, me: Identity, secret: bytes, expected_rank: int) -> None:
    """The dialling rank's half: hello, check the challenge, prove; HandshakeError if either side refuses."""
    nonce = new_nonce()
    send({"type": "hello", "identity": vars(me), "nonce": nonce})
    reply = recv()
    if reply.get("type") == "error":
        raise HandshakeError(f"refused by rank {expected_rank}: {reply.get('error')}")
    theirs = identity_of(reply)
    problem = mismatch(me, theirs)
    if problem is None and theirs.rank != expected_rank:
        problem = f"rank {theirs.rank} answered where rank {expected_rank} was expected"
    if problem is None and not verify(secret, "acceptor", str(reply.get("nonce")), nonce, theirs,
                                      str(reply.get("mac"))):
        problem = "authentication failed: the peer does not know the cluster secret"
    if problem:
        send({"type": "error", "error": problem})
        raise HandshakeError(f"refused rank {expected_rank}: {problem}")
    send({"type": "proof", "mac": proof(secret, "connector", nonce, str(reply["nonce"]), me)})
    final = recv()
    if final.get("type") != "ok":
        raise HandshakeError(f"refused by rank {expected_rank}: {final.get('error')}")


def accept_side(send: SendMessage, recv: RecvMessage, me: Identity, secret: bytes) -> int:
    """The accepting rank's half: check the hello, challenge, check the proof; returns the peer's rank."""
    hello = recv()
    theirs = identity_of(hello)
    problem = mismatch(me, theirs)
    if problem is None and theirs.rank < me.rank:
        problem = f"rank {theirs.rank} must accept, not connect (lower ranks accept)"
    if problem:
        send({"type": "error", "error": problem})
        raise HandshakeError(f"refused a connection claiming rank {theirs.rank}: {problem}")
    nonce = new_nonce()
    mac = proof(secret, "acceptor", nonce, str(hello.get("nonce")), me)
    send({"type": "challenge", "identity": vars(me), "nonce": nonce, "mac": mac})
    answer = recv()
    if answer.get("type") == "error":
        raise HandshakeError(f"rank {theirs.rank} refused us: {answer.get('error')}")
    if not verify(secret, "connector", str(hello.get("nonce")), nonce, theirs, str(answer.get("mac"))):
        problem = "authentication failed: wrong cluster secret"
        send({"type": "error", "error": problem})
        raise HandshakeError(f"refused rank {theirs.rank}: {problem}")
    send({"type": "ok"})
    return theirs.rank
