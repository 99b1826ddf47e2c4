"""The daemon side of the buffer socket: a pool of shared buffers, each owned by one trainer session.

A trainer connects to the unix socket, says hello with its session id and its job token (the
id alone claims nothing), and asks for buffers; the daemon creates them (memfd, mode 0600, for
"cpu", CUDA memory for "cuda:N") and passes them back. The connection *is* the session: when
it ends for any reason (the trainer closed it, exited or was killed), every buffer of the
session is freed and ``on_session_closed`` is called, so a dead trainer can never leak memory.
One thread per connection; a connection that sends anything malformed is dropped without
disturbing the others. ``get`` is safe to call from any thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zend.buffers import wire
from zend.buffers.cuda import CudaBuffer
from zend.buffers.shared import EXHAUSTED_ERRNOS, RESOURCE_EXHAUSTED, SharedBuffer, SharedBufferError

log = logging.getLogger("zend.buffers")

SOCKET_MODE = 0o660  # owner and group (the trainers' group) only: never world-writable
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class ClaimRefused(Exception):
    """Raised by ``authenticate`` to refuse a hello, with the reason the trainer is told."""


@dataclass(frozen=True)
class SessionInfo:
    """Who a session is: returned by the daemon's ``authenticate``; ``pid`` is filled in from the socket."""

    session_id: str
    job: str
    pid: int | None = None


@dataclass(eq=False)
class _Session:
    info: SessionInfo
    token: bytes  # what its claiming hello proved; a step connection must present it too
    buffers: dict[str, SharedBuffer] = field(default_factory=dict)
    nbytes: int = 0  # its buffers plus allocations in flight
    ended: bool = False
    attached: set[socket.socket] = field(default_factory=set)  # its extra step connections


StepHandler = Callable[[SessionInfo, wire.Step], dict[str, Any]]


class BufferServer:
    """The daemon-owned buffer pool behind a unix socket.

    Args:
        path: where to bind the socket (removed again by :meth:`close`).
        authenticate: maps a hello's session id and token to its :class:`SessionInfo`, None for an
            unknown session, or raises :class:`ClaimRefused` (a wrong token: the session must stay
            claimable by its own trainer).
        on_session_closed: called with the session id after a session's buffers are freed.
        on_step: runs a trainer's "step" request (the daemon's Submit) and returns the reply body;
            None: steps are refused (Submit over gRPC only).
        max_session_bytes: the most bytes one session may hold.
        max_total_bytes: the most bytes all sessions together may hold.
        cuda_pool: whether "cuda:N" buffers are served (else only "cpu").
        hello_timeout_s: how long a new connection may take to say hello.
    """

    def __init__(self, path: str, authenticate: Callable[[str, str], SessionInfo | None], *,
                 on_session_closed: Callable[[str], None] = lambda s: None, on_step: StepHandler | None = None,
                 max_session_bytes: int = 64 << 30, max_total_bytes: int = 256 << 30, cuda_pool: bool = False,
                 hello_timeout_s: float = 10.0) -> None:
        self.path = path
        self._authenticate = authenticate
        self._on_session_closed = on_session_closed
        self._on_step = on_step
        self.max_session_bytes = max_session_bytes
        self.max_total_bytes = max_total_bytes
        self.cuda_pool = cuda_pool
        self._hello_timeout_s = hello_timeout_s
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._buffers: dict[str, tuple[str, SharedBuffer]] = {}
        self._pool_bytes = 0
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket file we bound
        self._closed = False

    def start(self) -> BufferServer:
        """Bind and listen; OSError naming the path if a live daemon holds it or it cannot be bound.

        A stale socket file (no listener behind it) is replaced; any other file is left alone.
        """
        if self._listener is not None or self._closed:
            raise RuntimeError(f"buffer server at {self.path!r} was already started")
        _remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o777 & ~SOCKET_MODE)  # born with SOCKET_MODE: no world-writable window
        try:
            listener.bind(self.path)
        except OSError as exc:
            listener.close()
            raise OSError(exc.errno, f"cannot bind buffer socket {self.path!r}: {exc.strerror or exc}") from exc
        finally:
            os.umask(old_umask)
        try:
            os.chmod(self.path, SOCKET_MODE)
            st = os.stat(self.path)
            self._socket_id = (st.st_dev, st.st_ino)
            listener.listen(128)
        except OSError:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(listener,),
                                               name="zend-buffers-accept", daemon=True)
        self._accept_thread.start()
        log.info("buffer socket listening at %s", self.path)
        return self

    def get(self, session_id: str, buffer_id: str) -> SharedBuffer:
        """The live buffer ``buffer_id`` of ``session_id``; SharedBufferError naming both otherwise."""
        with self._lock:
            entry = self._buffers.get(buffer_id)
            if entry is None or entry[0] != session_id:
                raise SharedBufferError(f"buffer {buffer_id!r} is not a live buffer of session {session_id!r}")
            return entry[1]

    def session_bytes(self, session_id: str) -> int:
        """Bytes the session holds (0 for a session without a live connection)."""
        with self._lock:
            session = self._sessions.get(session_id)
            return 0 if session is None else session.nbytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of all buffers currently allocated (and allocations in flight)."""
        with self._lock:
            return self._pool_bytes

    @property
    def sessions(self) -> list[str]:
        """Sessions with a live connection."""
        with self._lock:
            return list(self._sessions)

    def close(self) -> None:
        """Stop listening, drop every connection, free every buffer, remove the socket file; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            conns = list(self._conns)
            threads = list(self._threads)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes recv(); the connection's thread ends its session
        deadline = time.monotonic() + 5.0
        for thread in [*threads, *([self._accept_thread] if self._accept_thread else [])]:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = list(self._sessions.values())
        for session in left:  # threads that did not finish in time
            self._end_session(session)
        self._unlink_socket()

    def __enter__(self) -> BufferServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections --------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                log.warning("buffer socket %s: accept failed: %s", self.path, exc)
                time.sleep(0.1)  # e.g. out of descriptors: do not spin
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,), name="zend-buffers-conn", daemon=True)
                self._conns.add(conn)
                self._threads.add(thread)
                thread.start()  # under the lock: close() must never see (and join) a thread not yet started

    def _serve(self, conn: socket.socket) -> None:
        session: _Session | None = None
        pid = _peer_pid(conn)
        who = f"pid {pid}"
        attached = False
        try:
            conn.settimeout(self._hello_timeout_s)
            hello = _request(conn)
            if isinstance(hello, wire.Hello) and hello.attach:
                session, attached = self._attach(conn, hello, pid), True
            else:
                session = self._hello(conn, hello, pid)
            if session is None:
                return
            who = f"session {session.info.session_id!r} (pid {pid}, job {session.info.job!r})"
            wire.send_message(conn, wire.reply_ok(session=session.info.session_id))
            conn.settimeout(None)
            log.log(logging.DEBUG if attached else logging.INFO, "buffer socket: %s connected%s", who,
                    " (steps)" if attached else "")
            while True:
                request = _request(conn)
                if attached and not isinstance(request, wire.Step):
                    raise wire.ProtocolError("a step connection sends steps only")
                self._handle(conn, session, request)
        except wire.ProtocolError as exc:
            log.warning("buffer socket: dropping %s: %s", who, exc)
            with contextlib.suppress(OSError):
                conn.settimeout(1.0)
                wire.send_message(conn, wire.reply_error(f"protocol error: {exc}"))
        except OSError as exc:  # closed, reset or timed out
            log.debug("buffer socket: %s gone: %s", who, exc)
        except Exception:
            log.exception("buffer socket: dropping %s after an internal error", who)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()
            if session is not None and attached:
                with self._lock:
                    session.attached.discard(conn)
            elif session is not None:
                self._end_session(session)

    def _attach(self, conn: socket.socket, hello: wire.Hello, pid: int | None) -> _Session | None:
        """A step connection of a connected session, from the process that holds it, with the token
        that claimed it; None if refused."""
        session_id = hello.session
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and not session.ended and pid is not None and session.info.pid == pid \
                    and hmac.compare_digest(session.token, hello.token.encode()):
                session.attached.add(conn)
                return session
        error = (f"session {session_id!r} refused: no connected session of this process has that id"
                 if session is None else
                 f"session {session_id!r} refused: it belongs to another process" if session.info.pid != pid else
                 f"session {session_id!r} refused: the token given is not the one that claimed it")
        log.warning("buffer socket: pid %s: %s", pid, error)
        wire.send_message(conn, wire.reply_error(error))
        return None

    def _hello(self, conn: socket.socket, request: wire.Request, pid: int | None) -> _Session | None:
        """The registered session of a hello; None (after an error reply) if it is refused."""
        if not isinstance(request, wire.Hello):
            raise wire.ProtocolError(f"the first request must be 'hello', got {type(request).__name__.lower()!r}")
        session_id = request.session
        error = f"session {session_id!r} refused: the daemon does not know it"
        try:
            info = self._authenticate(session_id, request.token)
        except ClaimRefused as exc:  # the session, if it exists, stays unclaimed for its own trainer
            info, error = None, f"session {session_id!r} refused: {exc}"
        except Exception:
            log.exception("buffer socket: authenticate(%r) failed", session_id)
            info = None
        if info is not None and info.session_id == session_id:
            info = dataclasses.replace(info, pid=pid)
            with self._lock:
                if self._closed:
                    error = f"session {session_id!r} refused: the daemon is shutting down"
                elif session_id in self._sessions:
                    error = f"session {session_id!r} refused: it is already connected"
                else:
                    session = _Session(info, request.token.encode())
                    self._sessions[session_id] = session
                    return session
        log.warning("buffer socket: pid %s: %s", pid, error)
        wire.send_message(conn, wire.reply_error(error))
        return None

    def _handle(self, conn: socket.socket, session: _Session, request: wire.Request) -> None:
        if isinstance(request, wire.Hello):
            raise wire.ProtocolError("'hello' may be sent only once")
        if isinstance(request, wire.Step):
            if self._on_step is None:
                wire.send_message(conn, wire.reply_error("steps are not served on this socket: use Submit"))
                return
            wire.send_message(conn, self._on_step(session.info, request))
            return
        if isinstance(request, wire.Free):
            try:
                self._free(session, request.buffer)
            except SharedBufferError as exc:
                wire.send_message(conn, wire.reply_error(str(exc)))
                return
            wire.send_message(conn, wire.reply_ok(buffer=request.buffer))
            return
        try:
            buffer = self._alloc(session, request.nbytes, request.device)
        except SharedBufferError as exc:
            wire.send_message(conn, wire.reply_error(str(exc), exc.code))
            return
        reply = wire.reply_ok(buffer=buffer.buffer_id, nbytes=buffer.nbytes, device=buffer.device)
        if isinstance(buffer, CudaBuffer):
            try:
                reply["cuda_ipc"] = buffer.export()
            except SharedBufferError as exc:
                with contextlib.suppress(SharedBufferError):
                    self._free(session, buffer.buffer_id)
                wire.send_message(conn, wire.reply_error(str(exc)))
                return
            wire.send_message(conn, reply)
        else:
            wire.send_message(conn, reply, fd=buffer.fileno())

    def _alloc(self, session: _Session, nbytes: int, device: str) -> SharedBuffer:
        session_id = session.info.session_id
        if nbytes < 1:
            raise SharedBufferError(f"alloc: nbytes must be >= 1, got {nbytes}")
        if device != "cpu" and not self.cuda_pool:
            raise SharedBufferError(f"alloc: device {device!r} refused: this daemon serves 'cpu' buffers only")
        with self._lock:
            if session.nbytes + nbytes > self.max_session_bytes:
                raise SharedBufferError(f"alloc of {nbytes} bytes refused: session {session_id!r} holds "
                                        f"{session.nbytes} bytes, its limit is {self.max_session_bytes} bytes",
                                        RESOURCE_EXHAUSTED)
            if self._pool_bytes + nbytes > self.max_total_bytes:
                raise SharedBufferError(f"alloc of {nbytes} bytes refused: the daemon's pool holds "
                                        f"{self._pool_bytes} bytes, its limit is {self.max_total_bytes} bytes",
                                        RESOURCE_EXHAUSTED)
            session.nbytes += nbytes  # reserved while the buffer is created outside the lock
            self._pool_bytes += nbytes
            buffer_id = secrets.token_hex(8)
            while buffer_id in self._buffers:
                buffer_id = secrets.token_hex(8)
        try:
            try:
                if device == "cpu":
                    buffer = SharedBuffer.create(nbytes, buffer_id)
                else:
                    buffer = CudaBuffer.create(nbytes, buffer_id, device)
            except OSError as exc:
                if exc.errno not in EXHAUSTED_ERRNOS:
                    raise
                # this request fails; the session, its other buffers and its connection live on
                log.warning("buffer socket: alloc of %d bytes for session %s: %s", nbytes, session_id[:12], exc)
                raise SharedBufferError(f"alloc of {nbytes} bytes: the daemon is out of resources "
                                        f"({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror})",
                                        RESOURCE_EXHAUSTED) from None
        except BaseException:
            with self._lock:
                if not session.ended:
                    session.nbytes -= nbytes
                    self._pool_bytes -= nbytes
            raise
        with self._lock:
            if not session.ended:
                session.buffers[buffer_id] = buffer
                self._buffers[buffer_id] = (session_id, buffer)
                return buffer
        buffer.close()
        raise SharedBufferError(f"alloc: session {session_id!r} ended while its buffer was created")

    def _free(self, session: _Session, buffer_id: str) -> None:
        with self._lock:
            buffer = session.buffers.pop(buffer_id, None)
            if buffer is None:
                raise SharedBufferError(f"free: buffer {buffer_id!r} is not a live buffer of session "
                                        f"{session.info.session_id!r}")
            del self._buffers[buffer_id]
            session.nbytes -= buffer.nbytes
            self._pool_bytes -= buffer.nbytes
        buffer.close()

    def _end_session(self, session: _Session) -> None:
        """Free every buffer of the session, then tell the daemon; once per session."""
        session_id = session.info.session_id
        with self._lock:
            if session.ended:
                return
            session.ended = True
            if self._sessions.get(session_id) is session:
                del self._sessions[session_id]
            buffers = list(session.buffers.values())
            session.buffers.clear()
            for buffer in buffers:
                self._buffers.pop(buffer.buffer_id, None)
            self._pool_bytes -= session.nbytes
            freed, session.nbytes = session.nbytes, 0
            attached = list(session.attached)
        for conn in attached:  # its step connections end with it (their threads see the socket close)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for buffer in buffers:
            buffer.close()
        log.info("buffer socket: session %r (pid %s) closed, %d buffers (%d bytes) freed",
                 session_id, session.info.pid, len(buffers), freed)
        try:
            self._on_session_closed(session_id)
        except Exception:
            log.exception("buffer socket: on_session_closed(%r) failed", session_id)

    def _unlink_socket(self) -> None:
        """Remove the socket file if it is still the one we bound (not a later daemon's)."""
        if self._socket_id is None:
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._socket_id:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("buffer socket: cannot remove %s: %s", self.path, exc)


def _request(conn: socket.socket) -> wire.Request:
    message = wire.recv_message(conn)
    if message.fd is not None:
        os.close(message.fd)
        raise wire.ProtocolError("requests carry no file descriptor, but one was attached")
    return wire.parse_request(message.body)


def _peer_pid(conn: socket.socket) -> int | None:
    try:
        pid, _, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return None
    return int(pid)


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on; OSError naming the path if a daemon does or it is no socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"buffer socket path {path!r} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)
        log.info("buffer socket: removed stale socket file %s (no daemon behind it)", path)
        return
    except TimeoutError as exc:
        raise OSError(errno.EADDRINUSE, f"buffer socket {path!r} is in use by a live daemon (busy)") from exc
    except OSError as exc:
        raise OSError(exc.errno, f"cannot probe buffer socket {path!r}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"buffer socket {path!r} is in use by a live daemon")
