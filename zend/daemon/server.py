"""One zend daemon: settings in, every part started in order, stopped (or drained) cleanly.

Start order matters for failing fast: sockets, the gRPC server and the metrics port bind
first (a port that will not bind stops the daemon before it joins anyone), then membership
and the data plane; health turns SERVING once every peer is connected.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.buffers import BufferServer, SessionInfo
from zend.core.comm import Communicator
from zend.core.schemes import Scheme, make_scheme
from zend.daemon.jobs import JobRegistry, Session
from zend.daemon.membership import Membership, rendezvous, static_membership
from zend.daemon.metrics import DaemonMetrics
from zend.daemon.node import NodeSync
from zend.daemon.service import OperatorService, TrainerService
from zend.daemon.settings import Settings
from zend.transport import choose_transport, create, parse_uri
from zend.transport.handshake import load_secret

log = logging.getLogger("zend.daemon")
MAX_CONTROL_MESSAGE = 1 << 20  # control messages are small; anything bigger is refused by gRPC
SERVICES = ("zen.v1.Trainer", "zen.v1.Operator")


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.secret = load_secret(settings.secret_file or None)
        self.registry = JobRegistry(self.secret)
        self.metrics = DaemonMetrics(settings.rank)
        self.transport: Any = None
        self.transport_name = ""
        self.buffers: BufferServer | None = None
        self.grpc_server: grpc.Server | None = None
        self.health = health.HealthServicer()
        self.membership = Membership(settings.rank, settings.world_size, {}, settings.generation,
                                     settings.cluster_id, settings.agreed(), "not started")  # start() sets it
        self.node: NodeSync = None  # type: ignore[assignment]  # set by start()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Daemon:
        s = self.settings
        os.makedirs(s.socket_dir, mode=0o750, exist_ok=True)
        import torch

        gpu = torch.cuda.is_available()  # GPU buffers (CUDA IPC) wherever the daemon sees a GPU
        self.buffers = BufferServer(s.buffer_socket, self._claim_session, on_session_closed=self.end_session,
                                    max_session_bytes=s.max_session_bytes, max_total_bytes=s.max_pool_bytes,
                                    cuda_pool=gpu).start()
        self._start_grpc()
        if s.metrics_port:
            self.metrics.serve(s.metrics_host, s.metrics_port)  # OSError at once if the port is taken
        self.membership = self._find_membership()
        self._start_data_plane()
        self.node = NodeSync(self.transport if self.transport is not None else _Alone(),
                             self.registry, self.buffers.get, self.metrics, s.step_timeout_s)
        self.metrics.info.labels(str(s.rank), self.transport_name, ",".join(self.ucx_transports()),
                                 self.membership.source.split(" ")[0]).set(1)
        self.metrics.generation.set(self.membership.generation)
        self._spawn(self._housekeeping, "housekeeping")
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("daemon ready", extra={"event": "ready", "node": self.membership.rank,
                                        "nodes": self.membership.world_size, "transport": self.transport_name,
                                        "generation": self.membership.generation, "socket": s.grpc_socket})
        return self

    def _start_grpc(self) -> None:
        s = self.settings
        options = [("grpc.max_receive_message_length", MAX_CONTROL_MESSAGE),
                   ("grpc.max_send_message_length", 16 * MAX_CONTROL_MESSAGE)]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=s.grpc_workers, thread_name_prefix="grpc"),
                             options=options)
        pb_grpc.add_TrainerServicer_to_server(TrainerService(self), server)
        pb_grpc.add_OperatorServicer_to_server(OperatorService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (*(pb.DESCRIPTOR.services_by_name[n.split(".")[-1]].full_name for n in SERVICES),
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        if os.path.exists(s.grpc_socket):
            os.unlink(s.grpc_socket)  # the buffer server already proved no live daemon owns this folder
        old_umask = os.umask(0o117)  # the socket is created 0660: not world-writable
        try:
            addresses = [f"unix:{s.grpc_socket}", *([s.grpc_listen] if s.grpc_listen else [])]
            for address in addresses:
                try:
                    port = server.add_insecure_port(address)
                except RuntimeError as exc:
                    raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
                if port == 0:
                    raise OSError(f"cannot listen for gRPC on {address}")
            server.start()
        finally:
            os.umask(old_umask)
        self.grpc_server = server

    def _find_membership(self) -> Membership:
        s = self.settings
        if s.rendezvous:
            if s.rendezvous == "env":
                from zend.daemon.membership import from_environment

                host, port, world_size, rank = from_environment(os.environ)
            else:
                host, _, port_text = s.rendezvous.rpartition(":")
                port, world_size, rank = int(port_text), s.world_size, s.rank
            return rendezvous(host, port, rank, world_size, s.listen, cluster_id=s.cluster_id, agreed=s.agreed(),
                              timeout_s=s.connect_timeout_s)
        if not s.peers:  # one node: no data plane
            return Membership(0, 1, {}, s.generation, s.cluster_id, s.agreed(), "static")
        return static_membership(s.rank, s.world_size, list(s.peers), cluster_id=s.cluster_id, agreed=s.agreed(),
                                 generation=s.generation)

    def _start_data_plane(self) -> None:
        m, s = self.membership, self.settings
        if m.world_size == 1:
            self.transport_name = "none"
            return
        hosts = [parse_uri(u)[1] for _, u in sorted(m.peers.items())]
        backend, reason = choose_transport(s.transport, hosts)
        self.transport_name = backend
        log.info("transport chosen", extra={"event": "transport", "transport": backend, "reason": reason})
        _, host, port = parse_uri(s.listen or m.peers[m.rank])
        self.transport = create(f"{backend}://{host}:{port}", m.rank, m.world_size, cluster_id=m.cluster_id,
                                secret=self.secret, generation=m.generation, timeout_s=s.peer_timeout_s)
        addresses = {j: parse_uri(u)[1:] for j, u in m.peers.items()}
        self.transport.connect(addresses, timeout_s=s.connect_timeout_s)

    def ucx_transports(self) -> list[str]:
        if self.transport_name != "ucx":
            return []
        from zend.transport.ucx import active_transports

        return list(active_transports())

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _housekeeping(self) -> None:
        """Expire steps whose trainers never came and sessions never connected; refresh the gauges."""
        while not self._stopped.wait(0.5):
            self.node.expire()
            for s in self.registry.expire_unclaimed(self.settings.claim_timeout_s):
                self._session_gone(s, logging.WARNING, "session expired: its trainer never connected the buffer "
                                   "socket", "session_expired", after_s=self.settings.claim_timeout_s)
            m = self.metrics
            m.in_flight.set(self.node.table.in_flight())
            m.trainers.set(sum(1 for s in list(self.registry.sessions.values()) if s.claimed))
            m.pool_bytes.set(self.buffers.pool_bytes if self.buffers else 0)
            if self.transport is not None:
                for j, peer in self.transport.peers.items():
                    m.peer_up.labels(peer=str(j)).set(1 if peer.link is not None else 0)
                pool = self.transport.pool.stats
                m.receive_pool_bytes.set(pool.pooled_bytes)
                m.receive_pool_reuse.set(pool.reused / max(1, pool.reused + pool.allocated))

    # ------------------------------------------------------------------ sessions
    def _claim_session(self, session_id: str) -> SessionInfo | None:
        s = self.registry.claim(session_id)
        return None if s is None else SessionInfo(session_id, s.job)

    def end_session(self, session_id: str) -> None:
        s = self.registry.close_session(session_id)
        if s is not None:
            self._session_gone(s, logging.INFO, "session closed", "session_close")

    def _session_gone(self, s: Session, level: int, message: str, event: str, **extra: Any) -> None:
        """After a session left the registry: its partners' steps fail now, not at their deadline."""
        if self.node is not None:
            self.node.session_closed(s)
        log.log(level, message, extra={"event": event, "job": s.job, "local_rank": s.local_rank, "pid": s.pid,
                                       **extra})

    def new_scheme(self) -> Scheme:
        s = self.settings
        return make_scheme(s.scheme, seed=s.hash_seed, min_slice_width=s.min_slice_width,
                           reprofile_every=s.reprofile_every)

    # ------------------------------------------------------------------ stopping
    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Refuse new steps and sessions; wait for the steps in flight. Returns (completed, abandoned)."""
        self.node.draining = True
        for name in ("", *SERVICES):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        pending = self.node.table.open_steps()
        deadline = time.monotonic() + timeout_s
        for step in pending:
            step.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = sum(1 for step in pending if not step.done.is_set())
        log.info("drained", extra={"event": "drain", "completed": len(pending) - abandoned, "abandoned": abandoned})
        return len(pending) - abandoned, abandoned

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=1.0).wait(2.0)
        if self.buffers is not None:
            self.buffers.close()
        if self.transport is not None:
            self.transport.close()
        if os.path.exists(self.settings.grpc_socket):
            os.unlink(self.settings.grpc_socket)
        log.info("daemon stopped", extra={"event": "stopped"})

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)


class _Alone(Communicator):
    """The data plane of a one-node cluster: nobody to talk to (schemes never call it)."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def send(self, dst: int, tag: str, payload: Any) -> None:
        raise RuntimeError("one-node cluster has no peers")

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> Any:
        raise RuntimeError("one-node cluster has no peers")
