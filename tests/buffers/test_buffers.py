"""Shared buffers between a daemon and its trainers: real sockets, real processes, no mocks.

The daemon side (BufferServer) runs in the test process; trainers are subprocesses
(tests/buffers/trainer.py) or in-process BufferClients, and misbehaving peers are raw sockets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import logging
import os
import random
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.buffers.trainer import Trainer, token_of
from tests.helpers import poll_for
from tests.subprocess_env import with_project
from zend.buffers import (
    BufferClient,
    BufferServer,
    ClaimRefused,
    ProtocolError,
    SessionInfo,
    SharedBuffer,
    SharedBufferError,
    wire,
)
from zend.protocol.step import StepResult

pytestmark = pytest.mark.timeout(60)


class Daemon:
    """A BufferServer that knows a few sessions and records which ones closed."""

    KNOWN = ("alice", "bob", "eve")

    def __init__(self, path: str, **kwargs: Any) -> None:
        self.closed: list[str] = []
        self.closed_event = threading.Event()
        self.server = BufferServer(path, self._authenticate, on_session_closed=self._on_closed, **kwargs)

    def _authenticate(self, session_id: str, token: str) -> SessionInfo | None:
        if session_id not in self.KNOWN:
            return None
        if token != token_of(session_id):
            raise ClaimRefused("the token given is not the session's")
        return SessionInfo(session_id, job=f"job-of-{session_id}")

    def _on_closed(self, session_id: str) -> None:
        self.closed.append(session_id)
        self.closed_event.set()


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    path = str(tmp_path / "b.sock")
    assert len(path) < 100, f"unix socket path {path!r} too long"
    return path


@pytest.fixture
def daemon_factory(sock_path: str) -> Iterator[Callable[..., Daemon]]:
    daemons: list[Daemon] = []

    def make(**kwargs: Any) -> Daemon:
        daemon = Daemon(sock_path, **kwargs)
        daemons.append(daemon)
        daemon.server.start()
        return daemon

    try:
        yield make
    finally:
        for daemon in daemons:
            daemon.server.close()


@pytest.fixture
def daemon(daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory()


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    """Callables run at teardown, last first, even when the test failed."""
    actions: list[Callable[[], None]] = []
    try:
        yield actions
    finally:
        for action in reversed(actions):
            action()


def client(cleanup: list[Callable[[], None]], path: str, session: str) -> BufferClient:
    c = BufferClient(path, session, token_of(session), timeout_s=10)
    cleanup.append(c.close)
    return c


def trainer(cleanup: list[Callable[[], None]], path: str, session: str) -> Trainer:
    t = Trainer(path, session)
    cleanup.append(t.kill)
    return t


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# -- a trainer in another process -------------------------------------------------------------

@pytest.mark.daemon
def test_trainer_and_daemon_share_the_same_memory(daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    t = trainer(cleanup, server.path, "alice")
    buffer_id = t.call(cmd="alloc", nbytes=4096)["buffer"]
    assert server.sessions == ["alice"] and server.session_bytes("alice") == 4096 == server.pool_bytes

    t.call(cmd="write", buffer=buffer_id, offset=64, values=[1.5, 2.5, 3.5])
    view = server.get("alice", buffer_id).view(torch.float32, 64, 3)
    assert view.tolist() == [1.5, 2.5, 3.5]
    t.call(cmd="write", buffer=buffer_id, offset=64, values=[7.0, 8.0, 9.0])
    assert view.tolist() == [7.0, 8.0, 9.0], "the daemon's view taken earlier sees new writes: no copy"

    view[1] = -4.0  # and the other way round
    assert t.call(cmd="read", buffer=buffer_id, offset=64, count=3)["values"] == [7.0, -4.0, 9.0]

    t.call(cmd="free", buffer=buffer_id)
    assert server.pool_bytes == 0
    with pytest.raises(SharedBufferError, match=buffer_id):
        server.get("alice", buffer_id)
    assert view.tolist() == [7.0, -4.0, 9.0], "a view of a freed buffer stays memory safe"

    assert t.exit() == 0
    assert daemon.closed_event.wait(5) and daemon.closed == ["alice"]
    assert server.sessions == []


@pytest.mark.daemon
def test_killed_trainer_frees_its_buffers_and_leaves_nothing_in_dev_shm(
        daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    shm_before = shm_entries()
    t = trainer(cleanup, server.path, "alice")
    ids = [t.call(cmd="alloc", nbytes=n)["buffer"] for n in (1 << 20, 12345)]
    t.call(cmd="write", buffer=ids[0], offset=0, values=[1.0, 2.0])
    held = server.get("alice", ids[0]).view(torch.float32, 0, 2)  # a daemon view outlives the session
    assert server.pool_bytes == (1 << 20) + 12345

    os.kill(t.proc.pid, signal.SIGKILL)
    t.proc.wait(10)
    def freed() -> bool:
        assert server.pool_bytes == 0, f"pool still holds {server.pool_bytes} bytes"
        return True

    poll_for(freed, 5, "the killed trainer's buffers freed", interval_s=0.01, ignore=(AssertionError,))
    assert daemon.closed_event.wait(5) and daemon.closed == ["alice"]
    assert server.sessions == [] and server.session_bytes("alice") == 0
    assert held.tolist() == [1.0, 2.0]
    del held
    assert shm_entries() - shm_before == set()


# -- limits -----------------------------------------------------------------------------------

@pytest.mark.inprocess
def test_over_limit_allocs_are_refused_naming_the_numbers_and_the_session_goes_on(
        daemon_factory: Callable[..., Daemon], cleanup: list[Callable[[], None]]) -> None:
    server = daemon_factory(max_session_bytes=8192, max_total_bytes=10000).server
    alice = client(cleanup, server.path, "alice")
    first = alice.alloc(8192)
    with pytest.raises(SharedBufferError, match=r"alloc of 1 bytes refused: session 'alice' holds 8192 bytes, "
                                                r"its limit is 8192 bytes"):
        alice.alloc(1)
    alice.free(first.buffer_id)
    second = alice.alloc(4096)  # the same connection still works
    assert server.session_bytes("alice") == 4096

    bob = client(cleanup, server.path, "bob")
    bob.alloc(4096)
    with pytest.raises(SharedBufferError, match=r"alloc of 4096 bytes refused: the daemon's pool holds 8192 "
                                                r"bytes, its limit is 10000 bytes"):
        bob.alloc(4096)
    with pytest.raises(SharedBufferError, match=r"nbytes must be >= 1, got 0"):
        bob.alloc(0)
    with pytest.raises(SharedBufferError, match=r"device 'cuda:0' refused"):
        bob.alloc(16, "cuda:0")
    assert server.pool_bytes == 8192
    second.view(torch.uint8, 0, 4096).fill_(3)
    assert int(server.get("alice", second.buffer_id).view(torch.uint8, 0, 4096).sum()) == 3 * 4096

    alice.close()  # ending the session frees its buffers in the daemon
    poll_for(lambda: server.pool_bytes == 4096, 5, "alice's buffers freed", interval_s=0.01)
    bob.alloc(4096)


@pytest.mark.inprocess
def test_out_of_descriptors_refuses_that_alloc_as_resource_exhausted_and_the_session_goes_on(
        daemon_factory: Callable[..., Daemon], cleanup: list[Callable[[], None]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from zend.buffers import shared

    server = daemon_factory().server
    alice = client(cleanup, server.path, "alice")
    kept = alice.alloc(4096)

    def out_of_fds(*_: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(shared.os, "memfd_create", out_of_fds)
    with pytest.raises(SharedBufferError, match=r"alloc of 8192 bytes: the daemon is out of resources \(EMFILE: "
                                                r"Too many open files\)") as info:
        alice.alloc(8192)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    monkeypatch.undo()
    assert server.session_bytes("alice") == 4096  # the refused request reserved nothing
    again = alice.alloc(8192)  # the same connection and session
    kept.view(torch.uint8, 0, 4).fill_(7)
    assert int(server.get("alice", kept.buffer_id).view(torch.uint8, 0, 4).sum()) == 28
    assert server.sessions == ["alice"] and again.nbytes == 8192


# -- sessions and ownership -------------------------------------------------------------------

@pytest.mark.inprocess
def test_a_session_cannot_reach_another_sessions_buffer(daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    alice, bob = client(cleanup, server.path, "alice"), client(cleanup, server.path, "bob")
    buf = alice.alloc(256)
    with pytest.raises(SharedBufferError, match=rf"buffer '{buf.buffer_id}' is not a live buffer of session 'bob'"):
        server.get("bob", buf.buffer_id)
    with pytest.raises(SharedBufferError, match=r"buffer 'nope' is not a live buffer of session 'alice'"):
        server.get("alice", "nope")
    with pytest.raises(SharedBufferError, match=rf"free: buffer '{buf.buffer_id}' is not a live buffer of session"):
        bob.free(buf.buffer_id)
    assert server.get("alice", buf.buffer_id).nbytes == 256
    bob.alloc(16)  # bob's connection survived the refusal


@pytest.mark.inprocess
def test_refused_and_duplicate_sessions_and_absent_daemon(
        daemon: Daemon, cleanup: list[Callable[[], None]], tmp_path: Path) -> None:
    with pytest.raises(SharedBufferError, match=r"session 'mallory' refused"):
        BufferClient(daemon.server.path, "mallory", token_of("mallory"))
    client(cleanup, daemon.server.path, "alice")
    with pytest.raises(SharedBufferError, match=r"session 'alice' refused: it is already connected"):
        BufferClient(daemon.server.path, "alice", token_of("alice"))
    absent = str(tmp_path / "none.sock")
    with pytest.raises(ConnectionError, match=absent):
        BufferClient(absent, "alice", token_of("alice"))
    assert daemon.server.sessions == ["alice"]


@pytest.mark.inprocess
def test_a_claim_needs_the_sessions_token_and_a_refused_one_leaves_the_session_to_its_trainer(
        daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    """issue 14, item 7: the session id alone claims nothing; a wrong or missing token is refused with
    a message, and the session is still there for the trainer that holds the token."""
    path = daemon.server.path
    with pytest.raises(SharedBufferError, match=r"session 'alice' refused: the token given is not the session's"):
        BufferClient(path, "alice", token_of("bob"))  # another session's (another job's) good token
    replies = raw_exchange(path, frame({"op": "hello", "session": "alice"}))
    assert len(replies) == 1 and "missing field 'token'" in replies[0]["error"], replies
    replies = raw_exchange(path, frame({"op": "hello", "session": "alice", "token": "x" * 64}))
    assert len(replies) == 1 and replies[0]["error"] == ("session 'alice' refused: the token given is not the "
                                                        "session's"), replies
    assert daemon.server.sessions == [] and daemon.closed == []

    alice = client(cleanup, path, "alice")  # the session's own trainer claims it after all that
    buf = alice.alloc(64)
    buf.view(torch.int32, 0, 1)[0] = 7
    assert daemon.server.get("alice", buf.buffer_id).view(torch.int32, 0, 1).item() == 7
    with pytest.raises(SharedBufferError, match=r"session 'alice' refused: the token given is not the one that "
                                                r"claimed it"):
        BufferClient(path, "alice", token_of("bob"), attach=True)  # even from the claiming process
    step_link = BufferClient(path, "alice", token_of("alice"), attach=True)
    cleanup.append(step_link.close)
    assert daemon.server.sessions == ["alice"] and alice.alloc(8).nbytes == 8


@pytest.mark.inprocess
def test_a_buffers_memfd_is_mode_0600_on_both_sides(daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    """issue 14, item 7: a memfd is born 0777; the daemon's are its owner's only (the trainer maps the
    descriptor it was passed, it never opens the inode)."""
    own = SharedBuffer.create(4096, "own")
    try:
        st = os.fstat(own.fileno())
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    finally:
        own.close()
    alice = client(cleanup, daemon.server.path, "alice")
    received = alice.alloc(4096)
    daemons = daemon.server.get("alice", received.buffer_id)
    assert os.path.samestat(os.fstat(received.fileno()), os.fstat(daemons.fileno()))
    assert stat.S_IMODE(os.fstat(received.fileno()).st_mode) == 0o600
    received.view(torch.float32, 0, 1)[0] = 2.5  # mapped read-write all the same
    assert daemons.view(torch.float32, 0, 1).item() == 2.5


@pytest.mark.inprocess
def test_close_frees_everything_and_removes_the_socket(daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    alice = client(cleanup, server.path, "alice")
    alice.alloc(1000)
    server.close()
    assert server.pool_bytes == 0 and server.sessions == [] and daemon.closed == ["alice"]
    assert not os.path.exists(server.path)
    with pytest.raises((ConnectionError, SharedBufferError)):
        alice.alloc(10)
    server.close()  # idempotent


def memfds_named(name: str) -> list[str]:
    """This process's descriptors on memfd `name` (the buffer's own, and each live mmap's copy of it)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name}"):
                found.append(fd)
    return found


@pytest.mark.inprocess
def test_a_buffer_held_only_by_garbage_is_unmapped_when_its_session_ends_and_a_live_view_is_named(
        daemon: Daemon, cleanup: list[Callable[[], None]], caplog: pytest.LogCaptureFixture) -> None:
    """A view caught in a reference cycle (an exception's frames holding a step's parts: views into the
    trainers' buffers) is garbage that only the collector frees, and a daemon whose trainers left may not
    collect for hours: the session's memory, and the mmap's copy of its memfd, would outlive it. The
    session's end collects when it left such mappings; a view still referenced is named in the log."""
    server = daemon.server
    alice, bob = client(cleanup, server.path, "alice"), client(cleanup, server.path, "bob")
    a, b = alice.alloc(1 << 16).buffer_id, bob.alloc(1 << 16).buffer_id
    held_a, held_b = server.get("alice", a), server.get("bob", b)
    cycle: list[Any] = [held_a.view(torch.uint8, 0, 16)]
    cycle.append(cycle)  # garbage once dropped: only the collector frees it
    live = held_b.view(torch.uint8, 0, 16)
    del cycle
    gc.disable()  # the collector must not run by chance: the session's end has to
    try:
        assert memfds_named(f"zend-buffer-{a}")  # the daemon's descriptor and its mmap's, the client's too
        alice.close()
        poll_for(lambda: "alice" in daemon.closed, 5, "alice's session closed")
        poll_for(lambda: not held_a.still_mapped, 5, "the garbage view's mapping released")
        assert memfds_named(f"zend-buffer-{a}") == []

        with caplog.at_level(logging.WARNING, logger="zend.buffers"):
            bob.close()
            poll_for(lambda: any("still mapped" in r.getMessage() for r in caplog.records), 5, "the warning")
        assert held_b.still_mapped and len(memfds_named(f"zend-buffer-{b}")) == 1, "a live view keeps its mapping"
        assert any(b in r.getMessage() and "still mapped" in r.getMessage() for r in caplog.records), caplog.text
        del live
        assert not held_b.still_mapped and memfds_named(f"zend-buffer-{b}") == []
    finally:
        gc.enable()


# -- peers that misbehave ---------------------------------------------------------------------

def frame(body: object) -> bytes:
    data = json.dumps(body).encode()
    return struct.pack("<I", len(data)) + data


HELLO_EVE = frame({"op": "hello", "session": "eve", "token": token_of("eve")})
GARBAGE = {
    "random bytes": random.Random(0).randbytes(3000),
    "huge length": struct.pack("<I", 0xFFFFFFFF) + b"{}",
    "length over 64 KiB": struct.pack("<I", (64 << 10) + 1) + b"x" * 100,
    "zero length": struct.pack("<I", 0),
    "invalid json": struct.pack("<I", 9) + b"{not json",
    "invalid utf-8": struct.pack("<I", 4) + b"\xff\xfe\xfd\xfc",
    "json array": frame([1, 2, 3]),
    "deeply nested": struct.pack("<I", 60000) + b"[" * 60000,
    "alloc before hello": frame({"op": "alloc", "nbytes": 10, "device": "cpu"}),
    "unknown session": frame({"op": "hello", "session": "mallory", "token": token_of("mallory")}),
    "hello without session": frame({"op": "hello", "token": token_of("eve")}),
    "session not a string": frame({"op": "hello", "session": 5, "token": token_of("eve")}),
    "hello without token": frame({"op": "hello", "session": "eve"}),
    "wrong token": frame({"op": "hello", "session": "eve", "token": token_of("alice")}),
    "empty token": frame({"op": "hello", "session": "eve", "token": ""}),
    "token not ascii": frame({"op": "hello", "session": "eve", "token": "t\u00f6ken\ud800"}),
    "unknown op": HELLO_EVE + frame({"op": "steal"}),
    "nbytes a string": HELLO_EVE + frame({"op": "alloc", "nbytes": "10", "device": "cpu"}),
    "nbytes a bool": HELLO_EVE + frame({"op": "alloc", "nbytes": True, "device": "cpu"}),
    "bad device": HELLO_EVE + frame({"op": "alloc", "nbytes": 10, "device": "tpu:0"}),
    "second hello": HELLO_EVE + HELLO_EVE,
    "truncated message": struct.pack("<I", 100) + b'{"op":',
}


def raw_exchange(path: str, data: bytes, fd: int | None = None, prefix: bytes = b"") -> list[dict[str, Any]]:
    """Send ``prefix``, then ``data`` (with ``fd`` attached), then read replies until the daemon closes the
    connection (or 5 s pass)."""
    replies: list[dict[str, Any]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        try:
            if prefix:
                sock.sendall(prefix)
                replies.append(wire.recv_message(sock).body)
            if fd is None:
                sock.sendall(data)
            else:
                socket.send_fds(sock, [data], [fd])
            if data.startswith(struct.pack("<I", 100)):
                sock.shutdown(socket.SHUT_WR)  # the truncated message ends here
            while True:
                message = wire.recv_message(sock)
                if message.fd is not None:
                    os.close(message.fd)
                replies.append(message.body)
        except (ConnectionError, BrokenPipeError):
            return replies  # dropped
        except TimeoutError:
            replies.append({"still": "open"})
            return replies


@pytest.mark.inprocess
@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_drops_only_that_connection(case: str, daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    alice = client(cleanup, server.path, "alice")
    held = alice.alloc(4096)
    held.view(torch.int64, 0, 1)[0] = 42

    replies = raw_exchange(server.path, GARBAGE[case])
    assert {"still": "open"} not in replies, f"{case}: the connection was not dropped"
    errors = [r for r in replies if r.get("ok") is False]
    assert errors or not replies, f"{case}: {replies}"

    assert server.get("alice", held.buffer_id).view(torch.int64, 0, 1).item() == 42
    assert alice.alloc(64).nbytes == 64, "the well-behaved session still works"
    assert client(cleanup, server.path, "bob").alloc(64).nbytes == 64, "new sessions still work"
    # the garbage's session (if it got one) goes with its connection, which may close before the daemon drops it
    poll_for(lambda: sorted(server.sessions) == ["alice", "bob"], 5, "only alice's and bob's sessions",
             interval_s=0.01)
    assert server.pool_bytes == 4096 + 64 + 64


@pytest.mark.inprocess
def test_an_attached_fd_or_another_sessions_buffer_id_gets_nothing(
        daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    alice = client(cleanup, server.path, "alice")
    held = alice.alloc(4096)

    # eve names alice's buffer: refused, eve's connection stays usable
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as eve:
        eve.settimeout(5)
        eve.connect(server.path)
        for body in ({"op": "hello", "session": "eve", "token": token_of("eve")},
                     {"op": "free", "buffer": held.buffer_id}, {"op": "alloc", "nbytes": 8, "device": "cpu"}):
            wire.send_message(eve, body)
            message = wire.recv_message(eve)
            if message.fd is not None:
                os.close(message.fd)
            replies.append(message.body)
    assert replies[0]["ok"] and replies[2]["ok"]
    assert replies[1] == {"ok": False, "error": f"free: buffer {held.buffer_id!r} is not a live buffer of "
                                                 "session 'eve'"}

    # a request with a file descriptor attached (eve's own memfd, claiming alice's buffer id): dropped
    poll_for(lambda: server.sessions == ["alice"], 5, "eve's session gone", interval_s=0.01)  # closed on both sides
    fds_before = len(os.listdir("/proc/self/fd"))
    fake = SharedBuffer.create(4096, held.buffer_id)
    try:
        replies = raw_exchange(server.path, frame({"op": "free", "buffer": held.buffer_id}), fd=fake.fileno(),
                               prefix=HELLO_EVE)
        assert replies[0]["ok"] and "no file descriptor" in replies[-1]["error"] and len(replies) == 2
        replies = raw_exchange(server.path, HELLO_EVE, fd=fake.fileno())
        assert len(replies) == 1 and "no file descriptor" in replies[0]["error"]
    finally:
        fake.close()
    poll_for(lambda: len(os.listdir("/proc/self/fd")) == fds_before, 5, "every received fd closed: the daemon "
             "leaked none", interval_s=0.01)
    assert server.get("alice", held.buffer_id) is not None
    assert alice.alloc(8).nbytes == 8


@pytest.mark.inprocess
def test_many_garbage_connections_at_once_do_not_disturb_a_working_session(
        daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    server = daemon.server
    alice = client(cleanup, server.path, "alice")
    errors: list[BaseException] = []

    def attack() -> None:
        try:
            for case in sorted(GARBAGE):
                raw_exchange(server.path, GARBAGE[case])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attack) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        for _ in range(50):
            alice.free(alice.alloc(128).buffer_id)
    finally:
        for th in threads:
            th.join(30)
    assert not errors and server.pool_bytes == 0 and server.sessions == ["alice"]


@pytest.mark.inprocess
def test_protocol_rejects_malformed_requests_naming_the_problem() -> None:
    with pytest.raises(ProtocolError, match=r"alloc: missing field 'device'"):
        wire.parse_request({"op": "alloc", "nbytes": 5})
    with pytest.raises(ProtocolError, match=r"field 'nbytes' must be int, got bool"):
        wire.parse_request({"op": "alloc", "nbytes": False, "device": "cpu"})
    with pytest.raises(ProtocolError, match=r"device 'cuda:x' is not"):
        wire.parse_request({"op": "alloc", "nbytes": 5, "device": "cuda:x"})
    with pytest.raises(ProtocolError, match=r"unknown op 'drop'"):
        wire.parse_request({"op": "drop"})
    with pytest.raises(ProtocolError, match=r"exceeds 65536"):
        wire.encode({"op": "hello", "session": "x" * (64 << 10)})
    assert wire.parse_request({"op": "alloc", "nbytes": 5, "device": "cuda:3"}) == wire.Alloc(5, "cuda:3")
    with pytest.raises(ProtocolError, match=r"hello: missing field 'token'"):
        wire.parse_request({"op": "hello", "session": "s"})
    with pytest.raises(ProtocolError, match=r"hello: field 'token' must be printable ASCII"):
        wire.parse_request({"op": "hello", "session": "s", "token": "t\n"})
    hello = wire.parse_request({"op": "hello", "session": "s", "token": "secret-token"})
    assert hello == wire.Hello("s", "secret-token") and "secret-token" not in repr(hello)


@pytest.mark.inprocess
def test_a_step_result_on_the_wire_has_every_field_and_comes_back_equal() -> None:
    result = StepResult(7, 3, "auto:zen", 100, 90, 4096, {"exchange": 0.25, "commit": 0.5}, 2, 4)
    body = json.loads(json.dumps(result.to_wire()))
    assert body == dataclasses.asdict(result)  # a field added to StepResult and not to to_wire fails here
    assert StepResult.from_wire(body, 7) == result


# -- the socket file --------------------------------------------------------------------------

@pytest.mark.inprocess
def test_socket_is_not_world_writable_and_a_live_path_is_not_taken_over(
        daemon: Daemon, cleanup: list[Callable[[], None]]) -> None:
    path = daemon.server.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    client(cleanup, path, "alice")
    second = BufferServer(path, lambda s, t: None)
    start = time.monotonic()
    with pytest.raises(OSError, match=f"buffer socket '{path}' is in use by a live daemon") as info:
        second.start()
    assert info.value.errno == errno.EADDRINUSE and time.monotonic() - start < 3
    second.close()
    assert os.path.exists(path), "the failed server must not remove the live daemon's socket"
    assert daemon.server.sessions == ["alice"]


@pytest.mark.inprocess
def test_a_stale_socket_file_is_replaced_and_other_files_are_not(
        sock_path: str, daemon_factory: Callable[..., Daemon], cleanup: list[Callable[[], None]]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(sock_path)  # a daemon that died without removing its socket
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    server = daemon_factory().server
    assert client(cleanup, sock_path, "alice").alloc(8).nbytes == 8
    server.close()

    Path(sock_path).write_text("not a socket")
    with pytest.raises(OSError, match=f"buffer socket path '{sock_path}' exists and is not a socket"):
        BufferServer(sock_path, lambda s, t: None).start()
    assert Path(sock_path).read_text() == "not a socket"


# -- SharedBuffer on its own ------------------------------------------------------------------

@pytest.mark.inprocess
def test_view_bounds_and_alignment_errors_name_the_values() -> None:
    buf = SharedBuffer.create(64, "b1")
    try:
        with pytest.raises(SharedBufferError, match=r"offset=2 is not aligned to the 4-byte items of torch.float32"):
            buf.view(torch.float32, 2, 1)
        with pytest.raises(SharedBufferError, match=r"offset=60, count=2 torch.float32 ends at byte 68, "
                                                    r"past nbytes=64"):
            buf.view(torch.float32, 60, 2)
        with pytest.raises(SharedBufferError, match=r"count must be an integer >= 0, got -1"):
            buf.view(torch.float32, 0, -1)
        with pytest.raises(SharedBufferError, match=r"offset must be an integer >= 0, got -8"):
            buf.view(torch.float64, -8, 1)
        assert buf.view(torch.float64, 56, 1).shape == (1,) and buf.view(torch.uint8, 64, 0).numel() == 0
        whole = buf.view(torch.int32, 0, 16)
        buf.view(torch.int32, 60, 1)[0] = 7
        assert whole[15].item() == 7
    finally:
        buf.close()
    buf.close()  # idempotent
    with pytest.raises(SharedBufferError, match=r"buffer 'b1' is closed"):
        buf.view(torch.uint8, 0, 1)
    assert whole[15].item() == 7, "views taken before close stay readable until dropped"
    with pytest.raises(SharedBufferError, match=r"nbytes must be an integer >= 1, got 0"):
        SharedBuffer.create(0, "b2")


@pytest.mark.inprocess
def test_attach_checks_the_descriptor() -> None:
    owner = SharedBuffer.create(4096, "b3")
    fd = os.dup(owner.fileno())
    try:
        with pytest.raises(SharedBufferError, match=rf"fd {fd} holds 4096 bytes, fewer than nbytes=8192"):
            SharedBuffer.attach(fd, 8192, "b3")
        other = SharedBuffer.attach(fd, 4096, "b3")
        fd = -1  # owned by `other` now
        other.view(torch.float32, 0, 2).copy_(torch.tensor([1.0, 2.0]))
        assert owner.view(torch.float32, 0, 2).tolist() == [1.0, 2.0]
        other.close()
    finally:
        if fd >= 0:
            os.close(fd)
        owner.close()
    unsealed = os.memfd_create("unsealed")
    try:
        os.ftruncate(unsealed, 4096)
        with pytest.raises(SharedBufferError, match=rf"fd {unsealed} is not sealed against shrinking"):
            SharedBuffer.attach(unsealed, 4096, "b4")
    finally:
        os.close(unsealed)


# -- CUDA requests where there is no GPU (the GPU path itself is in tests/gpu) -------------------

@pytest.mark.inprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_cuda_requests_without_a_gpu_are_refused_naming_the_device(
        daemon_factory: Callable[..., Daemon], cleanup: list[Callable[[], None]]) -> None:
    server = daemon_factory(cuda_pool=True).server
    alice = client(cleanup, server.path, "alice")
    with pytest.raises(SharedBufferError, match=r"device 'cuda:0' is absent here \(0 CUDA devices\)"):
        alice.alloc(64, "cuda:0")
    assert server.pool_bytes == 0 and alice.alloc(64).nbytes == 64
    with pytest.raises(SharedBufferError, match=r"invalid request: alloc: device 'gpu' is not"):
        alice.alloc(64, "gpu")
    assert alice.alloc(64).nbytes == 64, "a bad request is refused by the client, the session lives on"


@pytest.mark.inprocess
def test_a_malformed_cuda_handle_names_the_field() -> None:
    from zend.buffers import CudaBuffer

    with pytest.raises(ProtocolError, match=r"cuda_ipc handle: missing field 'buffer'"):
        CudaBuffer.open({"nbytes": 4})
    with pytest.raises(ProtocolError, match=r"field 'nbytes' must be int, got str"):
        CudaBuffer.open({"buffer": "x", "nbytes": "4"})
    with pytest.raises(SharedBufferError, match=r"device 'cpu' is not 'cuda:N'"):
        CudaBuffer.open({"buffer": "x", "nbytes": 4, "device": "cpu"})


STEP = {"op": "step", "tensor": 1, "step": 0, "input": "in", "input_offset": 0, "nnz": 1, "result": "out",
        "result_offset": 0, "timeout_s": 5.0}


@pytest.mark.inprocess
def test_steps_run_on_extra_connections_of_the_session_and_end_with_it(daemon_factory, sock_path, cleanup):
    seen: list[tuple[str, int]] = []
    both_in = threading.Barrier(2, timeout=10)

    def on_step(info: SessionInfo, body: dict[str, Any]) -> dict[str, Any]:
        seen.append((info.session_id, body["step"]))
        if body["step"] in (1, 2):
            both_in.wait()  # two steps in flight at once, one per connection
        return wire.reply_ok(echo=body["step"])

    d = daemon_factory(ops={"step": on_step})
    main = client(cleanup, sock_path, "alice")
    extra = [BufferClient(sock_path, "alice", token_of("alice"), timeout_s=10, attach=True) for _ in range(2)]
    for c in extra:
        cleanup.append(c.close)
    replies: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda c=c, s=s: replies.append(c.call({**STEP, "step": s}, 10)))
               for c, s in zip(extra, (1, 2), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(r["echo"] for r in replies) == [1, 2]
    assert main.call({**STEP, "step": 3}, 10)["echo"] == 3  # the claiming connection may submit too
    assert sorted(seen) == [("alice", 1), ("alice", 2), ("alice", 3)]
    with pytest.raises((ConnectionError, SharedBufferError, ProtocolError)):
        extra[0].alloc(4096)  # a step connection sends steps only: it is dropped, the session is not
    assert d.closed == [] and main.alloc(4096).nbytes == 4096
    main.close()  # the session ends with its claiming connection, and its step connections with it
    poll_for(lambda: d.closed == ["alice"], 5, "alice's session closed", interval_s=0.01)
    with pytest.raises((ConnectionError, OSError)):
        extra[1].call(STEP, 5)


@pytest.mark.daemon
def test_a_step_connection_from_another_process_is_refused(daemon_factory, sock_path, cleanup):
    daemon_factory(ops={"step": lambda info, body: wire.reply_ok()})
    client(cleanup, sock_path, "alice")
    code = ("from zend.buffers import BufferClient\n"
            f"BufferClient({sock_path!r}, 'alice', {token_of('alice')!r}, timeout_s=10, attach=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=with_project())
    assert proc.returncode != 0 and "belongs to another process" in proc.stderr, proc.stderr[-500:]
    with pytest.raises(SharedBufferError, match="no connected session"):
        BufferClient(sock_path, "bob", token_of("bob"), timeout_s=10, attach=True)  # known, but nobody claimed it


@pytest.mark.inprocess
def test_steps_are_refused_where_the_daemon_does_not_serve_them(daemon, sock_path, cleanup):
    reply = client(cleanup, sock_path, "alice").call(STEP, 5)
    assert reply["ok"] is False and "not served" in reply["error"]


@pytest.mark.inprocess
@pytest.mark.parametrize("field, value, match", [
    ("timeout_s", 0, "timeout_s"), ("timeout_s", True, "timeout_s"), ("step", 2**63, "outside"),
    ("nnz", -1, "outside"), ("input", "", "characters"), ("tensor", "1", "must be int"),
])
def test_a_malformed_step_is_named(field, value, match):
    from zend.protocol.step import StepRequest

    with pytest.raises(ProtocolError, match=match):
        StepRequest.from_wire({**STEP, field: value})
