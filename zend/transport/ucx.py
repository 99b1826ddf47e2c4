"""ucx://: the data plane over UCX, through ucxx (PyPI `ucxx-cu12`, install the `ucx` extra).

UCX picks the fastest path it has: shared memory between processes of one host, TCP between
hosts, RDMA (InfiniBand / RoCE) where the UCX build has verbs, and CUDA memory directly
(cuda_copy / cuda_ipc) for GPU tensors, without staging through the host. The PyPI UCX has no
RDMA: for RDMA install a system UCX >= 1.19 and set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true.
`active_transports()` reports what UCX really uses; the daemon exports it as a metric.

ucxx is asyncio-based: one event loop per process runs on a background thread. Each link is
one UCX endpoint carrying, per message, a header (frame + tag) and then the payload. A link's
receive loop is a coroutine on that loop, landing each payload in a pooled block
(receive_pool.py) that `recv` hands out as it is; a send is one trip to the loop for header and payload. ucxx
is imported lazily, so a CPU-only install never loads UCX.

Environment defaults set before UCX starts (each only if unset):
UCXPY_PROGRESS_MODE=thread with UCXPY_ENABLE_PYTHON_FUTURE=1: UCX progresses on its own
thread and wakes the loop on completion. `blocking` is faster per message on loopback
(benchmarks/transport_throughput.py) but its loop polls whenever a receive is posted, and a
link always has one: an idle process used a whole core.
UCX_TLS=tcp,sm (+ cuda_copy,cuda_ipc where CUDA is present; tcp is needed by the connection
manager; in the emulated cluster force UCX_TLS=tcp, or UCX uses shared memory across hosts),
UCX_MM_ERROR_HANDLING=y (ucxx turns endpoint error handling on, and without this UCX then
silently drops shared memory for TCP), UCX_RNDV_THRESH=auto (ucxx's default of 8192 cut raw
UCX over TCP at 1 MiB from 1.9 to 0.39 GB/s), UCX_RNDV_FRAG_MEM_TYPE=host,
UCX_WARN_UNUSED_ENV_VARS=n.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from zend.transport.frames import DATA, FRAME, MAX_TAG_BYTES, FrameError, unpack_frame
from zend.transport.framing import Frames
from zend.transport.link_transport import LinkTransport
from zend.transport.peer_links import MAX_HANDSHAKES, HandshakeGate
from zend.transport.sealing import GCM_TAG

log = logging.getLogger("zend.transport")

UCX_DEFAULTS = {
    "UCXPY_PROGRESS_MODE": "thread",
    "UCXPY_ENABLE_PYTHON_FUTURE": "1",
    "UCX_TLS": "tcp,sm,cuda_copy,cuda_ipc",
    "UCX_MM_ERROR_HANDLING": "y",
    "UCX_RNDV_THRESH": "auto",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}
HEADER_BYTES = FRAME.size + MAX_TAG_BYTES + GCM_TAG  # a sealed link's tag carries its GCM tag
DEVICE_FLAG = 1 << 63  # set in the size field: the payload is GPU memory (clear links only)
# One dial attempt's bound; the dial loop retries until its own deadline. A connect to a peer
# whose listener is not up yet usually fails at once, but ucxx sometimes leaves create_endpoint
# waiting after the refusal (seen here: the error callback fired, the call hung for its whole
# timeout while the peer came up 0.5 s later).
CONNECT_ATTEMPT_S = 3.0
_NOTHING = torch.empty(0, dtype=torch.uint8)

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _ucx_loop() -> asyncio.AbstractEventLoop:
    """The process's one UCX event loop (UCX has one context per process)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            for key, value in UCX_DEFAULTS.items():
                if key == "UCX_TLS" and not torch.cuda.is_available():
                    value = "tcp,sm"  # naming absent CUDA transports makes UCX warn on stdout
                os.environ.setdefault(key, value)
            import ucxx  # heavy: loads libucx

            # ucxx's notifier thread runs until told to stop and inherits its creator's daemon flag:
            # created on the main thread (auto's probe, offered_transports) it is a non-daemon
            # thread, and the process hung at exit until SIGKILL. The hook runs before the
            # interpreter joins non-daemon threads (atexit would be too late); it can only fail
            # once shutdown has begun, when there is nothing left to stop.
            with contextlib.suppress(RuntimeError):
                threading._register_atexit(ucxx.stop_notifier_thread)  # type: ignore[attr-defined]
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ucx-loop", daemon=True).start()
        return _loop


def offered_transports() -> set[str]:
    """The transports this UCX build can use on this machine (its resources, per device)."""
    _ucx_loop()  # sets UCX's environment before ucxx loads
    import ucxx

    info = ucxx.get_ucp_context_info()
    names = set()
    for line in info.splitlines():  # lines like "#      resource 3  :  md 1  dev 0  flags -- tcp/eth0"
        if "resource" in line and "/" in line:
            names.add(line.rsplit("/", 1)[0].split()[-1])
    return names


def active_transports() -> list[str]:
    """The UCX transports this process really uses (e.g. tcp, posix/sysv = shared memory, rc)."""
    _ucx_loop()
    import ucxx

    return sorted(ucxx.get_active_transports())


class UcxTransport(LinkTransport):
    scheme = "ucx"
    _listener: Any = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # I/O in flight per link: closing a link cancels them, or a receive on it could wait forever
        self._in_flight: dict[int, set[Future[Any]]] = {}
        self._in_flight_lock = threading.Lock()
        # where a sealed payload is built before it goes, per link (its send lock orders the use)
        self._seal_scratch: dict[int, torch.Tensor] = {}

    def _run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None, link: Any = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, _ucx_loop())
        if link is not None:
            with self._in_flight_lock:
                self._in_flight.setdefault(id(link), set()).add(future)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"UCX operation did not complete within {timeout_s} s") from None
        finally:
            if link is not None:
                with self._in_flight_lock:
                    self._in_flight.get(id(link), set()).discard(future)

    def start(self) -> UcxTransport:
        import ucxx

        loop = _ucx_loop()

        gate = HandshakeGate(per_source=MAX_HANDSHAKES)  # UCX does not tell the client's address: one bound

        async def on_connect(endpoint: Any) -> None:
            # the handshake blocks on the loop; run it on a thread of its own, within the gate
            refusal = gate.enter("ucx")
            if refusal is not None:
                log.warning("rank %d: refused a UCX connection: %s", self.rank, refusal)
                endpoint.abort()
                return
            try:
                threading.Thread(target=self._accept_then_leave, args=(endpoint, gate), name="handshake",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had: this connection only
                gate.leave("ucx")
                endpoint.abort()

        async def listen() -> Any:
            return ucxx.create_listener(on_connect, self.port or None)

        self._listener = asyncio.run_coroutine_threadsafe(listen(), loop).result(self.timeout_s)
        self.port = self._listener.port
        return self

    def _accept_then_leave(self, endpoint: Any, gate: HandshakeGate) -> None:
        try:
            self.links.accept(endpoint, "a UCX client")
        finally:
            gate.leave("ucx")

    def _stop_backend(self) -> None:
        listener = self._listener
        if listener is not None:
            async def stop() -> None:
                listener.close()

            with contextlib.suppress(Exception):
                self._run(stop(), 5.0)

    def _open_link(self, address: tuple[str, int], timeout_s: float) -> Any:
        import ucxx

        attempt_s = min(timeout_s, CONNECT_ATTEMPT_S)
        try:
            return self._run(ucxx.create_endpoint(address[0], address[1], connect_timeout=attempt_s),
                             attempt_s + 1)
        except Exception as exc:  # ucxx raises its own error types for refused connections
            raise ConnectionError(f"UCX connect failed: {exc}") from None

    def _close_link(self, link: Any) -> None:
        # On the loop thread (UCX objects must not be touched from two threads at once): a
        # graceful close tells the peer at once; abort if the peer does not answer.
        async def abort() -> None:
            if link.closed:
                return
            try:
                await asyncio.wait_for(link.close(), 1.0)
            except Exception:  # the peer is gone or slow
                if not link.closed:
                    link.abort()

        with contextlib.suppress(Exception):  # already closed, or the peer is gone
            self._run(abort(), 5.0)
        with self._in_flight_lock:
            stuck = self._in_flight.pop(id(link), set())
            self._seal_scratch.pop(id(link), None)
        for future in stuck:  # whatever UCX did not end with the endpoint
            future.cancel()

    def _send_message(self, link: Any, data: bytes) -> None:
        self._io(link, link.send_obj(data), self.timeout_s)

    def _recv_message(self, link: Any) -> bytes:
        return bytes(self._io(link, link.recv_obj(), self.timeout_s))

    def _io(self, link: Any, coro: Coroutine[Any, Any, Any], timeout_s: float | None) -> Any:
        try:
            return self._run(coro, timeout_s, link)
        except (TimeoutError, FrameError):
            raise
        except Exception as exc:  # UCXX errors: the endpoint is broken
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None

    def _receive_frames(self, j: int, link: Any, frames: Frames) -> None:
        # The whole loop runs on the event loop: no hop between threads per message.
        self._io(link, self._receive_async(j, link, frames), None)

    async def _receive_async(self, j: int, link: Any, frames: Frames) -> None:
        header = np.empty(HEADER_BYTES, dtype=np.uint8)
        wire = np.empty(0, dtype=np.uint8)  # this link's landing place for sealed payloads, reused
        loop = asyncio.get_running_loop()
        while not self._closed:
            await link.recv(header)
            clear = header[: FRAME.size].tobytes()
            kind, tag_len, size = unpack_frame(clear)
            on_device = bool(size & DEVICE_FLAG)
            size &= ~DEVICE_FLAG
            if on_device and frames.sealed:
                raise FrameError("sent a GPU payload on a sealed link (sealed payloads go through the host)")
            # checked (sealed) before anything it announces is reserved or received
            tag = frames.open_head(clear, header[FRAME.size : FRAME.size + tag_len + frames.tag_overhead].tobytes())
            self._heard(j, arriving=size)  # the payload comes in one call: its size buys it time
            keep = self._admit(j, kind, tag, size)
            if kind == DATA and keep and self._must_wait(j, size):  # backpressure: off the loop; never for control
                await loop.run_in_executor(None, self._reserve, j, size)
            if not keep:  # read (sealed: opened, as its records are numbered) only to be dropped
                payload = _NOTHING
                if size:
                    sink = np.empty(frames.wire_size(size), dtype=np.uint8)
                    await link.recv(sink)
                    frames.open_all(memoryview(sink), memoryview(np.empty(size, dtype=np.uint8)))  # type: ignore[arg-type]
            elif on_device and torch.cuda.is_available():
                payload = torch.empty(size, dtype=torch.uint8, device="cuda")
                if size:
                    await link.recv(payload)  # UCX writes into GPU memory (cuda_copy/ipc)
            else:
                payload = self._payload_buffer(size)
                if size and frames.lands_in_place:
                    await link.recv(payload.numpy())
                elif size:
                    if wire.size < frames.wire_size(size):
                        wire = np.empty(frames.wire_size(size), dtype=np.uint8)
                    arrived = wire[: frames.wire_size(size)]
                    await link.recv(arrived)
                    frames.open_all(memoryview(arrived), memoryview(payload.numpy()))  # type: ignore[arg-type]
            self._received(j, kind, tag, payload, keep)
            del payload  # the block goes back to the pool as soon as its reader drops it

    def _send_control(self, link: Any, frames: Frames, kind: int) -> bool:
        frame = frames.head(kind, "", 0)

        async def send() -> None:
            await link.send(np.frombuffer(frame, dtype=np.uint8))

        try:  # bounded: a frozen peer must not hold the heartbeat thread (a UCX message goes whole or not)
            self._io(link, send(), 1.0)
        except TimeoutError:
            if frames.sealed:  # sealed and numbered, maybe gone, maybe not: the link's numbers are unsure
                raise ConnectionError("a sealed control frame did not go within 1 s") from None
            return False
        return True

    def _send_frame(self, link: Any, frames: Frames, head: bytes, data: torch.Tensor) -> None:
        size = data.numel()
        payload: Any = None
        if size and frames.sealed:  # sealed whole on the host (GPU payloads too), then sent as one UCX message
            with self._in_flight_lock:
                scratch = self._seal_scratch.get(id(link))
                if scratch is None or scratch.numel() < frames.wire_size(size):
                    scratch = torch.empty(frames.wire_size(size), dtype=torch.uint8)
                    if not link.closed:  # kept for the link's next sends (its close drops it)
                        self._seal_scratch[id(link)] = scratch
            payload = scratch[: frames.wire_size(size)].numpy()
            frames.seal_all(memoryview(data.cpu().numpy()), memoryview(payload))  # type: ignore[arg-type]
        elif size:  # in clear, GPU memory goes as it is; the flag tells the receiver where to land it
            payload = data if data.is_cuda else data.numpy()
            if data.is_cuda:
                flagged = int.from_bytes(head[12:20], "little") | DEVICE_FLAG
                head = head[:12] + flagged.to_bytes(8, "little") + head[20:]

        async def send() -> None:  # header and payload in one trip to the loop
            await link.send(np.frombuffer(head, dtype=np.uint8))
            if payload is not None:
                await link.send(payload)

        # no timeout: a send may take long at a slow rate; a lost peer's link is dropped by the
        # watchdog, which cancels what is in flight on it
        self._io(link, send(), None)
