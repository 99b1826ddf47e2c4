"""The trainer side of the buffer socket: ask the node's daemon for shared buffers.

The connection is the trainer's session: while it is open the daemon keeps the session's
buffers; closing it (or the trainer dying) frees them in the daemon. Thread safe: one request
at a time goes over the socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Any

from zend.buffers import fenced, wire
from zend.buffers.cuda import CudaBuffer
from zend.buffers.shared import SharedBuffer, SharedBufferError


class BufferClient:
    """A session with the daemon's buffer pool.

    Example::

        with BufferClient("/run/zend/buffers.sock", session_id, job_token) as buffers:
            buf = buffers.alloc(1 << 20)
            grad = buf.view(torch.float32, 0, 1000)   # write the gradient here, in place

    Raises:
        ConnectionError: no daemon listens at ``path`` (or it went away later).
        TimeoutError: the daemon did not answer within ``timeout_s``.
        SharedBufferError: the daemon refused the session or a request (its message).
    """

    def __init__(self, path: str, session_id: str, token: str, timeout_s: float = 10.0, attach: bool = False) -> None:
        """`token`: the job token the session was opened with (the daemon refuses a claim without it).
        `attach`: an extra connection of this process's connected session, for `call` only."""
        self.path = path
        self.session_id = session_id
        self._lock = threading.Lock()
        self._buffers: dict[str, SharedBuffer] = {}
        self._sock: socket.socket | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise ConnectionError(f"no zend daemon at buffer socket {path!r}: {exc.strerror}") from exc
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot connect to buffer socket {path!r}: {exc.strerror or exc}") from exc
        self._sock = sock
        try:
            self._request({"op": "hello", "session": session_id, "token": token,
                           **({"attach": True} if attach else {})})
        except BaseException:
            self.close()
            raise

    def alloc(self, nbytes: int, device: str = "cpu") -> SharedBuffer:
        """A new zero-filled buffer of ``nbytes`` bytes from the daemon ("cpu", or "cuda:N" as a CudaBuffer)."""
        with self._lock:
            reply, fd = self._exchange({"op": "alloc", "nbytes": nbytes, "device": device})
            buffer_id: str | None = None
            try:
                buffer_id = wire.reply_field(reply, "buffer", str)
                buffer = self._map(reply, buffer_id, nbytes, fd)
            except BaseException:
                if fd is not None:
                    os.close(fd)
                if buffer_id is not None:
                    with contextlib.suppress(Exception):  # do not leave the daemon holding what we cannot use
                        self._exchange({"op": "free", "buffer": buffer_id}, expect_fd=False)
                raise
            self._buffers[buffer_id] = buffer
            return buffer

    @staticmethod
    def _map(reply: dict[str, Any], buffer_id: str, nbytes: int, fd: int | None) -> SharedBuffer:
        """This side's buffer for an alloc reply; on success it owns ``fd``."""
        got = wire.reply_field(reply, "nbytes", int)
        if got != nbytes:
            raise wire.ProtocolError(f"alloc reply for {nbytes} bytes describes buffer {buffer_id!r} of {got} bytes")
        if "cuda_ipc" in reply:
            buffer = CudaBuffer.open(wire.reply_field(reply, "cuda_ipc", dict))
            if buffer.buffer_id != buffer_id or buffer.nbytes != got:
                buffer.close()
                raise wire.ProtocolError(f"alloc reply for buffer {buffer_id!r} holds the handle of buffer "
                                         f"{buffer.buffer_id!r} of {buffer.nbytes} bytes")
            return buffer
        if fd is None:
            raise wire.ProtocolError(f"alloc reply for buffer {buffer_id!r} came without its descriptor")
        if reply.get("device") == fenced.DEVICE:  # the test double of a device buffer
            return fenced.FencedBuffer.attach(fd, got, buffer_id)
        return SharedBuffer.attach(fd, got, buffer_id)

    def free(self, buffer: str) -> None:
        """Give buffer ``buffer`` (its id) back to the daemon and close this side's mapping."""
        with self._lock:
            self._exchange({"op": "free", "buffer": buffer}, expect_fd=False)
            local = self._buffers.pop(buffer, None)
        if local is not None:
            local.close()

    def close(self) -> None:
        """End the session: the daemon frees its buffers; this side's buffers are closed too. Idempotent."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a request waiting for its reply in another thread
        with self._lock:
            sock, self._sock = self._sock, None
            buffers = list(self._buffers.values())
            self._buffers.clear()
        if sock is not None:
            sock.close()
        for buffer in buffers:
            buffer.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def call(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send a request for an op the daemon serves here (its step doorbell) and return the reply as it
        is (ok, or error and code): the caller turns a refusal into its own error. Waits up to `timeout_s`."""
        with self._lock:
            if self._sock is not None:
                self._sock.settimeout(timeout_s)
            reply, _ = self._exchange(body, expect_fd=False, refusal_raises=False, extension=True)
            return reply

    def map_readonly(self, body: dict[str, Any], buffer_id: str, timeout_s: float) -> SharedBuffer:
        """Ask for an op that answers with a descriptor of memory sealed against writes (a checkpoint segment)
        and map it read-only; SharedBufferError with the daemon's words if refused."""
        with self._lock:
            if self._sock is not None:
                self._sock.settimeout(timeout_s)
            reply, fd = self._exchange(body, expect_fd=True, extension=True)
        if fd is None:
            raise SharedBufferError(f"zend daemon answered {body.get('op')!r} without a descriptor")
        nbytes = reply.get("nbytes")
        try:
            if not isinstance(nbytes, int) or nbytes < 1:
                raise SharedBufferError(f"zend daemon answered {body.get('op')!r} with nbytes={nbytes!r}")
            return SharedBuffer.attach_readonly(fd, nbytes, buffer_id)
        except BaseException:
            os.close(fd)
            raise

    def _request(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            reply, _ = self._exchange(body, expect_fd=False)
            return reply

    def _exchange(self, body: dict[str, Any], *, expect_fd: bool = True, refusal_raises: bool = True,
                  extension: bool = False) -> tuple[dict[str, Any], int | None]:
        """Send a request, receive its reply; SharedBufferError with the daemon's message on refusal
        (unless `refusal_raises` is off: the caller reads the refusal itself). An `extension` op is the
        daemon's to check (this side does not know its fields)."""
        try:  # what the daemon would drop the connection for is refused here
            wire.parse_request(body, frozenset({str(body.get("op"))}) if extension else frozenset())
        except wire.ProtocolError as exc:
            raise SharedBufferError(f"invalid request: {exc}") from exc
        sock = self._sock
        if sock is None:
            raise SharedBufferError(f"buffer client of session {self.session_id!r} is closed")
        try:
            unsent: OSError | None = None
            try:
                wire.send_message(sock, body)
            except (BrokenPipeError, ConnectionResetError) as exc:  # a daemon that refused the connection at
                unsent = exc  # once answered, then closed, maybe before this was sent: read its answer first
            try:
                message = wire.recv_message(sock)
            except (OSError, wire.ProtocolError):
                if unsent is not None:
                    raise unsent from None
                raise
        except BaseException as exc:
            self._sock = None  # a late or partial reply would desynchronise the stream: the session is over
            sock.close()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"zend daemon at {self.path!r} did not answer {body.get('op')!r} in time") from exc
            if isinstance(exc, ConnectionError):
                raise ConnectionError(f"zend daemon at {self.path!r} closed the buffer socket: {exc}") from exc
            raise
        fd = message.fd
        if fd is not None and not expect_fd:
            os.close(fd)
            fd = None
        try:
            error = wire.check_reply(message.body)
            if error is not None and refusal_raises:
                code = message.body.get("code")
                raise SharedBufferError(f"zend daemon refused {body.get('op')!r}: {error}",
                                        code if isinstance(code, str) else None)
        except BaseException:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        return message.body, fd
