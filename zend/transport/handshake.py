"""Authenticating a data-plane connection before anything else crosses it: the messages and the flow.

Challenge-response with HMAC-SHA256 over a shared cluster secret, both ways, the dialling rank
first: the accepting rank, which anyone can reach, reveals no MAC before the dialler has proven
that it knows the secret (a MAC given to a stranger would let it guess a weak secret offline).
Both sides also agree on the protocol version, cluster id, world size, membership generation
and data-plane security; a mismatch is refused with an error that names the field (and, to the
other side, which has not proven anything yet, only its own value: never the one expected). Each side
then derives the link's frame keys from the secret and the whole exchange (sealing.py), unless
both run with security "none". Messages are JSON (never pickle), parsed strictly (bounded size
and depth, finite numbers, exact types). `connect_side` and `accept_side` run the flow over two
callables that send and receive one message; each backend supplies them (and delimits the
messages its own way), so no socket is touched here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass

from zend.transport.sealing import SECURITY_MODES, LinkCipher

PROTOCOL_VERSION = 3  # 2: heartbeat and abort frames; 3: the dialler proves first, sealed frames
MAX_HANDSHAKE_BYTES = 4096
NONCE_HEX = 32  # characters of a nonce (16 random bytes)

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
    security: str = "aead"  # sealing.SECURITY_MODES


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


@dataclass(frozen=True)
class Mismatch:
    """A field where two sides differ: `local` names both values (this node's log and error), `told`
    only the other side's own (what an unauthenticated peer is told: never a value it should guess)."""

    local: str
    told: str


def mismatch(mine: Identity, theirs: Identity) -> Mismatch | None:
    """The first field that differs between two sides of one cluster."""
    for name, label in (("protocol", "protocol version"), ("cluster", "cluster id"),
                        ("world_size", "world size"), ("generation", "membership generation"),
                        ("security", "data-plane security")):
        a, b = getattr(theirs, name), getattr(mine, name)
        if a != b:
            return Mismatch(f"{label} {a!r} != {b!r}", f"{label} {a!r} is not this cluster's")
    if not 0 <= theirs.rank < mine.world_size:
        return Mismatch(f"rank {theirs.rank} outside world size {mine.world_size}",
                        f"rank {theirs.rank} is outside this cluster's world size")
    if theirs.rank == mine.rank:
        problem = f"rank {theirs.rank} is this node's own rank"
        return Mismatch(problem, problem)
    return None


def transcript(dialer: Identity, acceptor: Identity, dialer_nonce: str, acceptor_nonce: str) -> bytes:
    """Everything both sides said, in one canonical form: what the proofs and the frame keys bind."""
    return json.dumps([asdict(dialer), asdict(acceptor), dialer_nonce, acceptor_nonce], sort_keys=True).encode()


def proof(secret: bytes, role: str, said: bytes) -> str:
    """HMAC binding the secret to the whole exchange; the role keeps one direction's proof from
    passing for the other's (a reflected proof is refused)."""
    return hmac.new(secret, role.encode() + b"\0" + said, hashlib.sha256).hexdigest()


def verify(secret: bytes, role: str, said: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(proof(secret, role, said), mac)


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


IDENTITY_FIELDS = frozenset(Identity.__dataclass_fields__)
MESSAGE_FIELDS = {"hello": {"type", "identity", "nonce"}, "challenge": {"type", "identity", "nonce"},
                  "proof": {"type", "mac"}, "ok": {"type", "mac"}, "error": {"type", "error"}}


def expect(message: Message, kind: str) -> Message:
    """`message` if it is a `kind` message with exactly that kind's fields; else HandshakeError naming
    what differs (an error message from the other side is raised as its refusal)."""
    got = message.get("type")
    if got == "error" and kind != "error" and set(message) == MESSAGE_FIELDS["error"]:
        raise HandshakeError(f"refused: {str(message.get('error'))[:300]}")
    if got != kind:
        raise HandshakeError(f"expected a {kind} message, got type {str(got)[:40]!r}")
    extra, missing = set(message) - MESSAGE_FIELDS[kind], MESSAGE_FIELDS[kind] - set(message)
    if extra or missing:
        raise HandshakeError(f"{kind} message with unexpected fields {sorted(extra)[:5]} or missing "
                             f"{sorted(missing)}")
    return message


def identity_of(message: Message) -> Identity:
    try:
        fields = message["identity"]
        if not isinstance(fields, dict) or not isinstance(fields.get("cluster"), str):
            raise TypeError("identity is not an object with a cluster id")
        if set(fields) != IDENTITY_FIELDS:
            raise ValueError(f"identity fields {sorted(map(str, fields))[:8]} are not {sorted(IDENTITY_FIELDS)}")
        security = fields.get("security")
        if security not in SECURITY_MODES:
            raise ValueError(f"security={security!r:.40} is not one of {list(SECURITY_MODES)}")
        return Identity(_whole(fields, "protocol"), str(fields["cluster"]), _whole(fields, "world_size"),
                        _whole(fields, "generation"), _whole(fields, "rank"), str(security))
    except (KeyError, TypeError, ValueError) as exc:
        raise HandshakeError(f"handshake message lacks a valid identity ({exc}): {message!r:.200}") from None


def nonce_of(message: Message) -> str:
    nonce = message.get("nonce")
    if not (isinstance(nonce, str) and len(nonce) == NONCE_HEX and all(c in "0123456789abcdef" for c in nonce)):
        raise HandshakeError(f"handshake message has no valid nonce ({NONCE_HEX} hex digits): {nonce!r:.60}")
    return nonce


def _cipher(secret: bytes, said: bytes, me: Identity, dialer: bool) -> LinkCipher | None:
    return LinkCipher.for_side(secret, said, dialer) if me.security == "aead" else None


def connect_side(send: SendMessage, recv: RecvMessage, me: Identity, secret: bytes,
                 expected_rank: int) -> LinkCipher | None:
    """The dialling rank's half: hello, prove, check the acceptor's proof; returns the link's frame
    cipher (None with security "none"); HandshakeError if either side refuses."""
    nonce = new_nonce()
    send({"type": "hello", "identity": asdict(me), "nonce": nonce})
    try:
        reply = expect(recv(), "challenge")
    except HandshakeError as exc:
        raise HandshakeError(f"rank {expected_rank}: {exc}") from None
    theirs = identity_of(reply)
    problem = mismatch(me, theirs)
    if problem is None and theirs.rank != expected_rank:
        wrong = f"rank {theirs.rank} answered where rank {expected_rank} was expected"
        problem = Mismatch(wrong, wrong)
    if problem:
        send({"type": "error", "error": problem.told})
        raise HandshakeError(f"refused rank {expected_rank}: {problem.local}")
    said = transcript(me, theirs, nonce, nonce_of(reply))
    send({"type": "proof", "mac": proof(secret, "dialer", said)})
    try:
        final = expect(recv(), "ok")
    except HandshakeError as exc:
        raise HandshakeError(f"rank {expected_rank}: {exc}") from None
    if not verify(secret, "acceptor", said, final.get("mac")):
        raise HandshakeError(f"refused rank {expected_rank}: authentication failed: the peer does not know "
                             "the cluster secret")
    return _cipher(secret, said, me, dialer=True)


def accept_side(send: SendMessage, recv: RecvMessage, me: Identity, secret: bytes) -> tuple[int, LinkCipher | None]:
    """The accepting rank's half: check the hello, challenge with a nonce alone, check the proof,
    only then prove itself; returns the peer's rank and the link's frame cipher."""
    hello = expect(recv(), "hello")
    theirs = identity_of(hello)
    their_nonce = nonce_of(hello)
    problem = mismatch(me, theirs)
    if problem is None and theirs.rank < me.rank:
        wrong = f"rank {theirs.rank} must accept, not connect (lower ranks accept)"
        problem = Mismatch(wrong, wrong)
    if problem:  # the dialler has proven nothing yet: it is told which of its own values is refused, no more
        send({"type": "error", "error": problem.told})
        raise HandshakeError(f"refused a connection claiming rank {theirs.rank}: {problem.local}")
    nonce = new_nonce()
    send({"type": "challenge", "identity": asdict(me), "nonce": nonce})
    try:
        answer = expect(recv(), "proof")
    except HandshakeError as exc:
        raise HandshakeError(f"rank {theirs.rank}: {exc}") from None
    said = transcript(theirs, me, their_nonce, nonce)
    if not verify(secret, "dialer", said, answer.get("mac")):
        failed = "authentication failed: wrong cluster secret"
        send({"type": "error", "error": failed})
        raise HandshakeError(f"refused rank {theirs.rank}: {failed}")
    send({"type": "ok", "mac": proof(secret, "acceptor", said)})
    return theirs.rank, _cipher(secret, said, me, dialer=False)
