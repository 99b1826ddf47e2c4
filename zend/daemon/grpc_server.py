"""The daemon's gRPC servers: grpc.aio on one event loop thread, a bounded pool for the short calls.

A synchronous gRPC server runs every call on a thread of one pool, so calls that wait (a Submit
until the node's step is summed, a Ready until the membership is whole) held a thread each for
as long: 64 of them from one job took every thread, and health probes and other jobs' calls
timed out behind them. Here the calls that wait are coroutines on the event loop and hold no
thread; plain handlers (OpenSession, RegisterTensor, the Operator service) run on the pool
(`workers` threads); health (grpc-health-checking's own aio servicer) is answered on the loop
itself, so it never waits for the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection

Registration = tuple[Callable[[Any, Any], None], Any]  # (add_XServicer_to_server, servicer)
# A TCP port anyone on the network reaches: connections bounded in number, in the time to say hello (an
# idle connection that never sends HTTP/2's preface), and in idle time; 400 idle connections made health
# time out and kept a trainer out when none of this was set.
NETWORK_LISTENER_OPTIONS = (
    ("grpc.max_allowed_incoming_connections", 256),
    ("grpc.server_handshake_timeout_ms", 5_000),
    ("grpc.max_connection_idle_ms", 60_000),
)


class GrpcServers:
    """gRPC servers on one event loop (a thread of its own) sharing one pool of `workers` handler threads,
    which is also the loop's default executor (what coroutine handlers hand their short work to)."""

    def __init__(self, workers: int, options: Sequence[tuple[str, Any]] = ()):
        self.options = list(options)
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc")
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(self.pool)
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        self.servers: list[grpc.aio.Server] = []

    def serve(self, address: str, services: Sequence[Registration], reflected: Sequence[str],
              options: Sequence[tuple[str, Any]] = (), credentials: grpc.ServerCredentials | None = None) -> None:
        """A started server on `address` with `services` and reflection of the `reflected` service names,
        with `options` beside the servers' own, TLS if `credentials` are given; OSError if the address
        will not bind."""
        async def start() -> grpc.aio.Server:
            server = grpc.aio.server(migration_thread_pool=self.pool, options=[*self.options, *options])
            for add, servicer in services:
                add(servicer, server)
            reflection.enable_server_reflection((*reflected, reflection.SERVICE_NAME), server)
            try:
                port = (server.add_secure_port(address, credentials) if credentials is not None
                        else server.add_insecure_port(address))
            except RuntimeError as exc:
                port, why = 0, f": {exc}"
            else:
                why = ""
            if port == 0:
                await server.stop(None)
                raise OSError(f"cannot listen for gRPC on {address}{why}")
            await server.start()
            return server
        self.servers.append(asyncio.run_coroutine_threadsafe(start(), self.loop).result(30.0))

    def stop(self, grace_s: float) -> None:
        """Stop every server (calls in flight get `grace_s` to finish), then the loop and the pool."""
        async def stop_all() -> None:
            await asyncio.gather(*(server.stop(grace_s) for server in self.servers), return_exceptions=True)
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(grace_s + 2.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(2.0)
        if not self.loop.is_running():
            self.loop.close()  # its selector and wake-up pipe
        self.pool.shutdown(wait=False, cancel_futures=True)
