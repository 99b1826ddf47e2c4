"""The wire format of the buffer socket: small JSON messages, a buffer's file descriptor beside them.

Gradient bytes never cross this socket; only requests for buffers and the descriptors of the
buffers do. Each message is a 4-byte little-endian length and a UTF-8 JSON object of at most
``MAX_MESSAGE_BYTES``; a message may carry one file descriptor (``socket.send_fds``). Requests
(trainer -> daemon)::

    {"op": "hello", "session": "<id>", "token": "<t>"}   first, once
    {"op": "alloc", "nbytes": N, "device": "cpu"}        or "cuda:N"
    {"op": "free", "buffer": "<id>"}
    {"op": "<other>", ...}                                an op the daemon serves here (its step doorbell:
                                                          zend.protocol.step), passed on as it came

A trainer may open more connections to its session, for those other ops only, with ``{"op":
"hello", "session": "<id>", "token": "<t>", "attach": true}`` from the same process: one per thread
that submits, so that steps of different tensors overlap.

A hello's ``token`` is the job token the session was opened with: the session id alone claims
nothing (another job's process that learnt it must not take the session, nor its buffers). A
hello with a wrong token is refused and leaves the session to its trainer.

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "<message>"}``; an alloc reply adds
``"buffer"``, ``"nbytes"`` and ``"device"``, with the memfd attached for "cpu" or a
``"cuda_ipc"`` handle (see :mod:`zend.buffers.cuda`) for "cuda:N". Requests never carry a
descriptor. A connection the daemon will not serve (too many, in all or from one process) gets a
refusal with ``"code": "RESOURCE_EXHAUSTED"`` at once, maybe before its hello is read, and is
closed; one that has not said hello within the daemon's deadline gets a refusal and is closed.
Anything malformed raises :class:`ProtocolError`; the daemon then drops that one connection.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

HEADER = struct.Struct("<I")
MAX_MESSAGE_BYTES = 64 << 10
MAX_FDS = 1
MAX_ID_CHARS = 128
_DEVICE = re.compile(r"cpu|fenced|cuda:(0|[1-9][0-9]{0,3})")  # fenced: a test double (fenced.py), served only in tests


class ProtocolError(ValueError):
    """A malformed message on the buffer socket: the connection that sent it is dropped."""


@dataclass(frozen=True)
class Message:
    """A decoded message and the descriptor that came with it (the receiver owns and must close it)."""

    body: dict[str, Any]
    fd: int | None = None


@dataclass(frozen=True)
class Hello:
    session: str
    token: str = field(repr=False)  # the job token the session was opened with: a secret, never logged
    attach: bool = False  # an extra connection of a connected session, for steps only


@dataclass(frozen=True)
class Extension:
    """A request for an op the buffers themselves do not serve (the daemon's step doorbell), as it came."""

    op: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Alloc:
    nbytes: int
    device: str


@dataclass(frozen=True)
class Free:
    buffer: str


Request = Hello | Alloc | Free | Extension


def encode(body: dict[str, Any]) -> bytes:
    """Length prefix + JSON of one message; ProtocolError if it exceeds MAX_MESSAGE_BYTES."""
    data = json.dumps(body, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return HEADER.pack(len(data)) + data


def send_message(sock: socket.socket, body: dict[str, Any], fd: int | None = None) -> None:
    """Send one message, with ``fd`` attached to its first byte when given."""
    data = encode(body)
    if fd is None:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], [fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_message(sock: socket.socket) -> Message:
    """Receive one message.

    Raises:
        ConnectionError: the peer closed the connection between messages.
        ProtocolError: a bad length, a truncated message, more than one descriptor, or a body that
            is not a UTF-8 JSON object. Descriptors received with it are closed.
    """
    fds: list[int] = []
    try:
        header = _recv_exact(sock, HEADER.size, fds, at_boundary=True)
        (length,) = HEADER.unpack(header)
        if length == 0 or length > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message length {length} is outside 1..{MAX_MESSAGE_BYTES}")
        data = _recv_exact(sock, length, fds, at_boundary=False)
        if len(fds) > MAX_FDS:
            raise ProtocolError(f"message carries {len(fds)} file descriptors, at most {MAX_FDS} allowed")
        try:
            body = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ProtocolError(f"message is not UTF-8 JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ProtocolError(f"message is a JSON {type(body).__name__}, not an object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return Message(body, fds[0] if fds else None)


def _recv_exact(sock: socket.socket, n: int, fds: list[int], *, at_boundary: bool) -> bytes:
    """Exactly ``n`` bytes (never more: the next message's descriptor stays queued), collecting descriptors."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        data, new_fds, flags, _ = socket.recv_fds(sock, n - got, MAX_FDS + 1, socket.MSG_CMSG_CLOEXEC)
        fds.extend(new_fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"message carries more than {MAX_FDS + 1} file descriptors")
        if not data:
            if at_boundary and got == 0:
                raise ConnectionError("the peer closed the buffer socket")
            raise ProtocolError(f"connection closed {got} bytes into a {n}-byte read")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def parse_request(body: dict[str, Any], ops: frozenset[str] = frozenset()) -> Request:
    """The request a message body holds; ProtocolError naming the bad op or field. `ops`: the other ops
    the reader serves (passed on as an Extension, unchecked); any other is unknown."""
    op = body.get("op")
    if op == "hello":
        attach = body.get("attach", False)
        if not isinstance(attach, bool):
            raise ProtocolError(f"hello: field 'attach' must be bool, got {type(attach).__name__}")
        if "token" not in body:
            raise ProtocolError("hello: missing field 'token' (the job token the session was opened with; "
                                "a session id alone claims nothing)")
        token = checked_field(body, "token", str)
        if not (token.isascii() and token.isprintable()):
            raise ProtocolError("hello: field 'token' must be printable ASCII")
        return Hello(checked_field(body, "session", str), token, attach)
    if op == "alloc":
        nbytes = checked_field(body, "nbytes", int)
        device = checked_field(body, "device", str)
        if not _DEVICE.fullmatch(device):
            raise ProtocolError(f"alloc: device {device[:40]!r} is not 'cpu' or 'cuda:N'")  # (nor the test double)
        return Alloc(nbytes, device)
    if op == "free":
        return Free(checked_field(body, "buffer", str))
    if isinstance(op, str) and op in ops:
        return Extension(op, body)
    raise ProtocolError(f"unknown op {str(op)[:40]!r}: not served on this socket (expected 'hello', 'alloc', "
                        f"'free'{''.join(f', {o!r}' for o in sorted(ops))})")


def checked_field(body: dict[str, Any], name: str, kind: type) -> Any:
    """``body[name]``, checked to be of ``kind`` (bool is not an int here, strings are non-empty and short)."""
    op = body.get("op", "reply")
    if name not in body:
        raise ProtocolError(f"{op}: missing field {name!r}")
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{op}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, str) and not 0 < len(value) <= MAX_ID_CHARS:
        raise ProtocolError(f"{op}: field {name!r} must have 1..{MAX_ID_CHARS} characters, got {len(value)}")
    return value


def reply_ok(**fields: Any) -> dict[str, Any]:
    return {"ok": True, **fields}


def reply_error(message: str, code: str | None = None) -> dict[str, Any]:
    """A refusal; `code` (a status code name, for steps) lets the trainer raise the right error."""
    return {"ok": False, "error": message, **({"code": code} if code else {})}


def check_reply(body: dict[str, Any]) -> str | None:
    """The error of a refusal, None for success; ProtocolError if the body is no reply."""
    ok = body.get("ok")
    if ok is True:
        return None
    if ok is False:
        error = body.get("error")
        return error if isinstance(error, str) else f"refused without a message: {str(body)[:200]}"
    raise ProtocolError(f"reply without a boolean 'ok': {str(body)[:200]}")


def reply_field(body: dict[str, Any], name: str, kind: type) -> Any:
    """A checked field of a reply (same rules as request fields)."""
    return checked_field(body, name, kind)
