"""The daemon side of the buffer socket: a pool of shared buffers, each owned by one trainer session.

A trainer connects to the unix socket, says hello with its session id and its job token (the
id alone claims nothing), and asks for buffers; the daemon creates them (memfd, mode 0600, for
"cpu", CUDA memory for "cuda:N") and passes them back. The connection *is* the session: when
it ends for any reason (the trainer closed it, exited or was killed), every buffer of the
session is freed and ``on_session_closed`` is called, so a dead trainer can never leak memory.
One thread per connection, and a bounded number of them: past ``max_connections`` in all, or
``max_connections_per_pid`` from one process, a new connection is refused at once with a message
(no thread), and one that has not said hello within ``hello_timeout_s`` is closed; connections
already serving a session are never touched. A connection that sends anything malformed is
dropped without disturbing the others. ``get`` is safe to call from any thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zend.buffers import fenced, wire
from zend.buffers.cuda import CudaBuffer
from zend.buffers.shared import EXHAUSTED_ERRNOS, RESOURCE_EXHAUSTED, SharedBuffer, SharedBufferError

log = logging.getLogger("zend.buffers")

SOCKET_MODE = 0o660  # owner and group (the trainers' group) only: never world-writable
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_SWEEP_S = 0.25  # how often the accept loop looks for connections whose hello is late
_WARN_EVERY_S = 10.0  # refusals of one kind are logged once per this, with a count of the rest


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
    token: bytes  # what its claiming hello proved; an attached connection must present it too
    buffers: dict[str, SharedBuffer] = field(default_factory=dict)
    nbytes: int = 0  # its buffers plus allocations in flight
    ended: bool = False
    attached: set[socket.socket] = field(default_factory=set)  # its extra (extension op) connections


# an op the daemon serves on this socket beside the buffers' own (its step doorbell): the session that
# sent it and the message as it came -> the reply's body, or (body, fd) to pass a descriptor with it (closed
# once sent: a duplicate); wire.ProtocolError drops the connection
OpHandler = Callable[[SessionInfo, dict[str, Any]], dict[str, Any] | tuple[dict[str, Any], int]]


class BufferServer:
    """The daemon-owned buffer pool behind a unix socket.

    Args:
        path: where to bind the socket (removed again by :meth:`close`).
        authenticate: maps a hello's session id and token to its :class:`SessionInfo`, None for an
            unknown session, or raises :class:`ClaimRefused` (a wrong token: the session must stay
            claimable by its own trainer).
        on_session_closed: called with the session id after a session's buffers are freed.
        ops: the ops the daemon serves here beside alloc and free (its step doorbell,
            zend.protocol.step), by name; the buffers know nothing of them. An unknown op is refused.
        max_session_bytes: the most bytes one session may hold.
        max_total_bytes: the most bytes all sessions together may hold.
        max_job_bytes: the most bytes the sessions of one job (``SessionInfo.job``) may hold together
            (None: max_total_bytes).
        cuda_pool: whether "cuda:N" buffers are served (else only "cpu").
        hello_timeout_s: how long a new connection may take to say hello (all of it, not per read).
        max_connections: connections served at once, each on its own thread; more are refused.
        max_connections_per_pid: of them, from one process (peers of unknown pid, 0 when they live in
            another pid namespace, count only towards max_connections).
        max_step_connections: extra connections one session may attach (for `ops` only).
    """

    def __init__(self, path: str, authenticate: Callable[[str, str], SessionInfo | None], *,
                 on_session_closed: Callable[[str], None] = lambda s: None,
                 ops: Mapping[str, OpHandler] | None = None,
                 max_session_bytes: int = 64 << 30, max_total_bytes: int = 256 << 30, max_job_bytes: int | None = None,
                 cuda_pool: bool = False, hello_timeout_s: float = 5.0, max_connections: int = 1024,
                 max_connections_per_pid: int = 64, max_step_connections: int = 256) -> None:
        self.path = path
        self._authenticate = authenticate
        self._on_session_closed = on_session_closed
        self._ops = dict(ops or {})
        self.max_session_bytes = max_session_bytes
        self.max_total_bytes = max_total_bytes
        self.max_job_bytes = max_total_bytes if max_job_bytes is None else max_job_bytes
        self.cuda_pool = cuda_pool
        self._hello_timeout_s = hello_timeout_s
        self.max_connections, self.max_connections_per_pid = max_connections, max_connections_per_pid
        self.max_step_connections = max_step_connections
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._buffers: dict[str, tuple[str, SharedBuffer]] = {}
        self._pool_bytes = 0
        self._job_bytes: dict[str, int] = {}  # job -> bytes its sessions hold (and allocations in flight)
        self._conns: set[socket.socket] = set()
        self._pid_conns: dict[int, int] = {}  # peer pid (known ones) -> its connections
        self._hello_due: dict[socket.socket, float] = {}  # connections yet to say hello -> their deadline
        self._warned: dict[str, tuple[float, int]] = {}  # kind of refusal -> (last logged, refused since)
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

    def job_bytes(self, job: str) -> int:
        """Bytes the sessions of ``job`` hold together."""
        with self._lock:
            return self._job_bytes.get(job, 0)

    @property
    def connections(self) -> int:
        """Connections served now (each has its thread)."""
        with self._lock:
            return len(self._conns)

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
        listener.settimeout(_SWEEP_S)  # wakes to cut connections whose hello is late
        while True:
            self._cut_late_hellos()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed:
                    return
                log.warning("buffer socket %s: accept failed: %s", self.path, exc)
                time.sleep(0.1)  # e.g. out of descriptors: do not spin
                continue
            conn.settimeout(None)
            pid = _peer_pid(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                refusal = self._over_limit(pid)
                if refusal is None:
                    thread = threading.Thread(target=self._serve, args=(conn, pid), name="zend-buffers-conn",
                                              daemon=True)
                    self._conns.add(conn)
                    if pid:
                        self._pid_conns[pid] = self._pid_conns.get(pid, 0) + 1
                    self._hello_due[conn] = time.monotonic() + self._hello_timeout_s
                    self._threads.add(thread)
                    thread.start()  # under the lock: close() must never see (and join) a thread not yet started
            if refusal is not None:
                self._refuse(conn, pid, refusal)

    def _over_limit(self, pid: int | None) -> str | None:
        """(under _lock) Why a new connection from ``pid`` is refused, or None."""
        if len(self._conns) >= self.max_connections:
            return (f"the daemon serves {len(self._conns)} connections on its buffer socket, its limit "
                    f"(max_buffer_connections {self.max_connections}); try again later")
        held = self._pid_conns.get(pid, 0) if pid else 0
        if held >= self.max_connections_per_pid:
            return (f"process {pid} holds {held} connections to the buffer socket, its limit "
                    f"(max_buffer_connections_per_pid {self.max_connections_per_pid})")
        return None

    def _refuse(self, conn: socket.socket, pid: int | None, error: str) -> None:
        """Answer a connection refused at accept with the reason, close it (it never gets a thread)."""
        try:
            conn.setblocking(False)  # a new connection's send buffer is empty: the reply fits
            wire.send_message(conn, wire.reply_error(f"connection refused: {error}", "RESOURCE_EXHAUSTED"))
        except OSError:
            pass
        finally:
            conn.close()
        self._warn("refused", f"buffer socket: refused a connection from pid {pid}: {error}")

    def _warn(self, kind: str, message: str) -> None:
        """A WARNING, once per _WARN_EVERY_S for each kind (a flood of refusals must not flood the log)."""
        now = time.monotonic()
        with self._lock:
            last, quiet = self._warned.get(kind, (-_WARN_EVERY_S, 0))
            if now - last < _WARN_EVERY_S:
                self._warned[kind] = (last, quiet + 1)
                return
            self._warned[kind] = (now, 0)
        log.warning("%s%s", message, f" ({quiet} more like it in the last {now - last:.0f} s)" if quiet else "")

    def _cut_late_hellos(self) -> None:
        """Stop reading from connections past their hello deadline: their thread answers and closes them."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, due in self._hello_due.items() if due <= now]
            for conn in late:
                del self._hello_due[conn]
        for conn in late:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)  # wakes its thread's recv(), which then finds it late

    def _said_hello(self, conn: socket.socket) -> bool:
        """The hello came in time (it is no longer due); False if the connection was cut as late."""
        with self._lock:
            return self._hello_due.pop(conn, None) is not None

    def _late_hello(self, conn: socket.socket, pid: int | None) -> None:
        error = f"no hello within {self._hello_timeout_s:g} s: connection closed"
        with contextlib.suppress(OSError):
            conn.settimeout(1.0)
            wire.send_message(conn, wire.reply_error(error))
        self._warn("late", f"buffer socket: pid {pid}: {error}")

    def _serve(self, conn: socket.socket, pid: int | None) -> None:
        session: _Session | None = None
        who = f"pid {pid}"
        attached = False
        try:
            conn.settimeout(self._hello_timeout_s)  # a trickled hello is cut by _cut_late_hellos at its deadline
            try:
                hello: wire.Request | None = _request(conn)
            except TimeoutError:  # silent for the whole deadline
                self._said_hello(conn)
                hello = None
            except (OSError, wire.ProtocolError):
                if self._said_hello(conn):  # an ordinary drop, before the deadline
                    raise
                hello = None
            else:
                if not self._said_hello(conn):
                    hello = None
            if hello is None:  # cut at its deadline, or complete only after it
                self._late_hello(conn, pid)
                return
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
                    " (attached)" if attached else "")
            while True:
                request = _request(conn, frozenset(self._ops))
                if attached and not isinstance(request, wire.Extension):
                    raise wire.ProtocolError(f"an attached connection sends only {sorted(self._ops)}")
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
                self._hello_due.pop(conn, None)
                if pid and pid in self._pid_conns:
                    self._pid_conns[pid] -= 1
                    if self._pid_conns[pid] <= 0:
                        del self._pid_conns[pid]
                self._threads.discard(threading.current_thread())
            conn.close()
            if session is not None and attached:
                with self._lock:
                    session.attached.discard(conn)
            elif session is not None:
                self._end_session(session)

    def _attach(self, conn: socket.socket, hello: wire.Hello, pid: int | None) -> _Session | None:
        """An attached connection of a connected session, from the process that holds it, with the token
        that claimed it; None if refused."""
        session_id = hello.session
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.ended or pid is None:
                error = "no connected session of this process has that id"
            elif session.info.pid != pid:
                error = "it belongs to another process"
            elif not hmac.compare_digest(session.token, hello.token.encode()):
                error = "the token given is not the one that claimed it"
            elif len(session.attached) >= self.max_step_connections:
                error = (f"it has {len(session.attached)} attached connections, its limit "
                         f"({self.max_step_connections}); submit from fewer threads")
            else:
                session.attached.add(conn)
                return session
        error = f"session {session_id!r} refused: {error}"
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
        if isinstance(request, wire.Extension):
            reply = self._ops[request.op](session.info, request.body)
            if isinstance(reply, tuple):  # (body, fd): a descriptor goes with it (a checkpoint segment), then is
                try:  # closed here: the handler gives a duplicate of its own
                    wire.send_message(conn, reply[0], fd=reply[1])
                finally:
                    os.close(reply[1])
            else:
                wire.send_message(conn, reply)
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
            except SharedBufferError as exc:  # this buffer is refused; the session lives on
                log.warning("buffer socket: %s", exc)
                with contextlib.suppress(SharedBufferError):
                    self._free(session, buffer.buffer_id)
                wire.send_message(conn, wire.reply_error(str(exc), exc.code))
                return
            wire.send_message(conn, reply)
        else:
            wire.send_message(conn, reply, fd=buffer.fileno())

    def _alloc(self, session: _Session, nbytes: int, device: str) -> SharedBuffer:
        session_id = session.info.session_id
        if nbytes < 1:
            raise SharedBufferError(f"alloc: nbytes must be >= 1, got {nbytes}")
        if device == fenced.DEVICE and not fenced.enabled():
            raise SharedBufferError(f"alloc: device {device!r} refused: a test double, served only with "
                                    f"{fenced.ENV}=1")
        if device not in ("cpu", fenced.DEVICE) and not self.cuda_pool:
            raise SharedBufferError(f"alloc: device {device!r} refused: this daemon serves 'cpu' buffers only")
        job = session.info.job
        with self._lock:
            if session.nbytes + nbytes > self.max_session_bytes:
                raise SharedBufferError(f"alloc of {nbytes} bytes refused: session {session_id!r} holds "
                                        f"{session.nbytes} bytes, its limit is {self.max_session_bytes} bytes "
                                        "(max_session_bytes)", RESOURCE_EXHAUSTED)
            held = self._job_bytes.get(job, 0)
            if held + nbytes > self.max_job_bytes:  # one job never takes the pool from the others
                raise SharedBufferError(f"alloc of {nbytes} bytes refused: job {job!r} holds {held} bytes on this "
                                        f"node, its quota is {self.max_job_bytes} bytes (max_job_buffer_bytes)",
                                        RESOURCE_EXHAUSTED)
            if self._pool_bytes + nbytes > self.max_total_bytes:
                raise SharedBufferError(f"alloc of {nbytes} bytes refused: the daemon's pool holds "
                                        f"{self._pool_bytes} bytes, its limit is {self.max_total_bytes} bytes "
                                        "(max_pool_bytes)", RESOURCE_EXHAUSTED)
            self._charge(session, nbytes)  # reserved while the buffer is created outside the lock
            buffer_id = secrets.token_hex(8)
            while buffer_id in self._buffers:
                buffer_id = secrets.token_hex(8)
        try:
            try:
                if device == "cpu":
                    buffer = SharedBuffer.create(nbytes, buffer_id)
                elif device == fenced.DEVICE:
                    buffer = fenced.FencedBuffer.create(nbytes, buffer_id)
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
                    self._charge(session, -nbytes)
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
            self._charge(session, -buffer.nbytes)
        buffer.close()

    def _charge(self, session: _Session, nbytes: int) -> None:
        """(under _lock) Count ``nbytes`` more (or fewer) for the session, its job and the pool."""
        session.nbytes += nbytes
        self._pool_bytes += nbytes
        job = session.info.job
        held = self._job_bytes.get(job, 0) + nbytes
        if held > 0:
            self._job_bytes[job] = held
        else:
            self._job_bytes.pop(job, None)

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
            freed = session.nbytes
            self._charge(session, -freed)
            attached = list(session.attached)
        for conn in attached:  # its attached connections end with it (their threads see the socket close)
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
        held = release_mappings(buffers)  # after the daemon hears (its local rank is free again): a collection
        if held:  # takes tens of ms
            log.warning("buffer socket: session %r closed, but %d of its buffers are still mapped here (%s): a "
                        "view of them is still referenced; their memory goes with the last view",
                        session_id, len(held), ", ".join(held[:4]))

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


def release_mappings(buffers: list[Any]) -> list[str]:
    """The ids of closed `buffers` still mapped once garbage is collected.

    A closed buffer's mapping (and the mmap's own copy of its descriptor) lives while any view of it
    does. A view caught in a reference cycle (an exception's frames holding a step's parts, views into
    the trainers' buffers) goes only when the collector runs, and in a daemon whose trainers left, with
    little allocated, that may be never: a session's memory would outlive it. So when a session ends
    holding such mappings, collect once (tens of ms, and only then)."""
    if not any(getattr(b, "still_mapped", False) for b in buffers):
        return []
    gc.collect()
    return [b.buffer_id for b in buffers if getattr(b, "still_mapped", False)]


def _request(conn: socket.socket, ops: frozenset[str] = frozenset()) -> wire.Request:
    message = wire.recv_message(conn)
    if message.fd is not None:
        os.close(message.fd)
        raise wire.ProtocolError("requests carry no file descriptor, but one was attached")
    return wire.parse_request(message.body, ops)


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
