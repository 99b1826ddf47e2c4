"""One zend daemon: the composition root. Settings in, every part built, started in order, stopped cleanly.

Each part gets only the collaborators it uses (the services a registry, the trainer steps and
a few callables; the trainer steps a buffer lookup and the node's steps), so this is the one module
that knows them all. Start order matters for failing fast: sockets, the gRPC server and the
metrics port bind first (a port that will not bind stops the daemon before it joins anyone),
then membership and the data plane; health turns SERVING once every peer is connected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.buffers import BufferServer, ClaimRefused, SessionInfo, wire
from zend.buffers.cuda import no_expandable_segments
from zend.core.comm import Communicator
from zend.core.schemes import Scheme, make_scheme
from zend.daemon import admission, socket_steps
from zend.daemon import errors as codes
from zend.daemon.backoff import Backoff
from zend.daemon.checkpoint_keeper import CheckpointKeeper, DataPlane
from zend.daemon.checkpoint_recovery import CENSUS_KEY, CENSUS_TENSOR
from zend.daemon.checkpoint_replication import CKPT_TENSOR
from zend.daemon.checkpoints import CheckpointStore
from zend.daemon.elastic import ElasticRendezvous
from zend.daemon.errors import FAILED_PRECONDITION, StepError
from zend.daemon.generations import Generations
from zend.daemon.grpc_server import NETWORK_LISTENER_OPTIONS, GrpcServers, Registration
from zend.daemon.jobs import JobRegistry, Session, operator_token, where_the_job_is
from zend.daemon.membership import Membership, MembershipError, first_line, rendezvous, static_membership
from zend.daemon.metrics import DaemonMetrics, NodeReadings
from zend.daemon.node_state import (
    NodeStateHolder,
    TransitionRefused,
    accept_failed,
    accept_recovered,
    changed,
    changing,
    drain,
    joined,
    still_joining,
    stopping,
    undrain,
)
from zend.daemon.node_steps import NodeSteps
from zend.daemon.operator_service import OperatorService
from zend.daemon.operator_tls import OperatorTls
from zend.daemon.round_store import RendezvousTls
from zend.daemon.secret import load_secret
from zend.daemon.settings import Settings
from zend.daemon.socket_steps import SocketSteps
from zend.daemon.status import CheckpointStatus, NodeStatus, PeerStatus, SessionStatus, TensorStatus
from zend.daemon.steps import STEP_WINDOW, StepKey
from zend.daemon.trainer_service import TrainerService
from zend.daemon.trainer_steps import TrainerSteps
from zend.protocol.checkpoint import SEGMENT_OP
from zend.protocol.version import daemon_version
from zend.transport import choose_transport, create, parse_uri
from zend.transport.engine_choice import choose_engine
from zend.transport.link_transport import LinkTransport, PeerState
from zend.transport.native_tcp import NativeTcpTransport

log = logging.getLogger("zend.daemon")
MAX_CONTROL_MESSAGE = 1 << 20  # control messages are small; anything bigger is refused by gRPC
SERVICES = ("zen.v1.Trainer", "zen.v1.Operator")


class Stopping(Exception):
    """start() was interrupted by a stop request (a signal) before the daemon served."""


class Daemon:
    def __init__(self, settings: Settings):
        import torch

        s = self.settings = settings
        self.secret = load_secret(s.secret_file or None)
        # TLS on the operator endpoints (OperatorTlsError, naming the file, before anything listens)
        self.operator_tls = (OperatorTls(s.operator_tls_cert_file, s.operator_tls_key_file)
                             if s.operator_tls_cert_file else None)
        self.metrics = DaemonMetrics(max(s.rank, 0))  # --rank auto: 0 until the rendezvous assigns one
        self.registry = JobRegistry(self.secret, s.max_tensors_per_job, s.max_session_bytes, s.max_sessions_per_job)
        # GPU buffers (CUDA IPC) wherever the daemon sees a GPU, never in expandable segments (IPC cannot share them)
        if torch.cuda.is_available():
            no_expandable_segments()
        self.buffers = BufferServer(s.buffer_socket, self._claim_session, on_session_closed=self.end_session,
                                    ops={socket_steps.OP: lambda info, body: self.socket_steps(info, body),
                                         SEGMENT_OP: lambda info, body: self._checkpoint_segment(info, body)},
                                    max_session_bytes=s.max_session_bytes, max_total_bytes=s.max_pool_bytes,
                                    max_job_bytes=s.job_buffer_bytes, cuda_pool=torch.cuda.is_available(),
                                    hello_timeout_s=s.buffer_hello_timeout_s,
                                    max_connections=s.max_buffer_connections,
                                    max_connections_per_pid=s.max_buffer_connections_per_pid)
        self.node_state = NodeStateHolder(self._set_serving)  # the one home of joining/serving/changing/draining
        self.trainer_steps = TrainerSteps(self.registry, self.buffers.get, self.metrics, s.step_timeout_s,
                                          s.max_submits_in_flight_per_job, lambda: self.node_state.state,
                                          self._learn_tensor_step)
        self.socket_steps = SocketSteps(self.registry, self.trainer_steps, self.metrics.count_error)
        self.transport: LinkTransport | None = None
        self.transport_name = ""
        # in-memory checkpoints (GEMINI): held here and by `checkpoint_replicas` peers
        self.checkpoints = (CheckpointKeeper(CheckpointStore(s.checkpoint_memory_bytes, s.job_checkpoint_bytes),
                                             self.buffers.get, self._checkpoint_plane, s.checkpoint_replicas,
                                             s.step_timeout_s, lambda: self.trainer_steps.in_flight() > 0,
                                             self.metrics.record_checkpoint, self.metrics.record_recovery)
                            if s.checkpoint_memory_bytes else None)
        self.engine_name = "python"  # the data-plane engine of tcp:// links (engine_choice.py)
        self.grpc: GrpcServers | None = None  # the unix socket (every service) and --grpc-listen (TCP)
        self.health = health_aio.HealthServicer()  # answered on the gRPC event loop, never behind busy handlers
        self.membership = Membership(s.rank, s.world_size, {}, s.generation, s.cluster_id, s.agreed(),
                                     "not started")  # start() finds the real one
        self.elastic: ElasticRendezvous | None = None  # with --elastic 1: the rounds a restarted node rejoins
        self.last_change = ("", 0.0)  # (what made the current generation, unix time)
        self.job_steps: dict[str, int] = {}  # job -> its step when this generation formed (--elastic)
        self.tensor_steps: dict[tuple[str, int], int] = {}  # (job, tensor id) -> a step it reached elsewhere
        self._steps_lock = threading.Lock()  # learned steps only rise: one writer at a time
        self.metrics.watch(self.readings)
        self._stopped = threading.Event()
        self._stop_requested = threading.Event()  # SIGTERM / SIGINT, also while start() is still joining
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Daemon:
        s = self.settings
        make_undumpable()  # before the first buffer exists
        raise_descriptor_limit()
        os.makedirs(s.socket_dir, mode=0o750, exist_ok=True)
        self.buffers.start()
        self._start_grpc()
        if s.metrics_port:
            # OSError at once if the port is taken; job and tensor names only for the operator token
            self.metrics.serve(s.metrics_host, s.metrics_port, operator_token(self.secret),
                               self.operator_tls.context if self.operator_tls is not None else None)
        if s.data_plane_security == "none":
            log.warning("DATA PLANE IN CLEAR: --data-plane-security none; gradients between daemons can be read "
                        "and rewritten by anyone on the path", extra={"event": "security", "security": "none"})
        self.membership = self._find_membership()
        self._start_data_plane()
        self._open_steps()
        m = self.membership
        self._spawn(self._housekeeping, "housekeeping")
        if self.elastic is not None:
            keeper = Generations(self.elastic, self, lambda: self.job_steps, self._stopped)
            self._spawn(keeper.watch, "membership")
        self.node_state.apply(joined)  # SERVING, unless drained while it was joining
        log.info("daemon ready", extra={"event": "ready", "node": m.rank, "nodes": m.world_size,
                                        "transport": self.transport_name, "generation": m.generation,
                                        "socket": s.grpc_socket})
        return self

    def _services(self) -> tuple[TrainerService, OperatorService]:
        s, count_error = self.settings, self.metrics.count_error
        trainer = TrainerService(self.registry, self.trainer_steps, lambda: self.membership, s.buffer_socket,
                                 self.new_scheme, self.end_session, s.step_timeout_s, count_error, self.not_whole,
                                 self.job_step, self.checkpoints, self.tensor_step)
        trainer.record_restore = self.metrics.record_restore
        operator = OperatorService(self.status, self.drain, self.undrain, s.drain_timeout_s, count_error,
                                   operator_token(self.secret))
        return trainer, operator

    def _start_grpc(self) -> None:
        """Every service on the unix socket; on --grpc-listen (TCP) the Operator service and health only,
        unless --grpc-listen-trainers 1 adds the Trainer service there (job tokens in clear on the network)."""
        s = self.settings
        trainer, operator = self._services()
        if os.path.exists(s.grpc_socket):
            os.unlink(s.grpc_socket)  # the buffer server already proved no live daemon owns this folder
        self.grpc = GrpcServers(s.grpc_workers, [("grpc.max_receive_message_length", MAX_CONTROL_MESSAGE),
                                                 ("grpc.max_send_message_length", 16 * MAX_CONTROL_MESSAGE)])
        self.node_state.sync_health()  # NOT_SERVING: still joining
        old_umask = os.umask(0o117)  # the socket is created 0660: not world-writable
        try:
            self._grpc_server(f"unix:{s.grpc_socket}", operator, trainer)
        finally:
            os.umask(old_umask)
        if s.grpc_listen:
            if s.grpc_listen_trainers:
                log.warning("the Trainer service is served on TCP too: job tokens cross the network in clear",
                            extra={"event": "trainers_on_tcp", "address": s.grpc_listen})
            self._grpc_server(s.grpc_listen, operator, trainer if s.grpc_listen_trainers else None,
                              NETWORK_LISTENER_OPTIONS,
                              self.operator_tls.grpc_credentials() if self.operator_tls is not None else None)

    def _grpc_server(self, address: str, operator: OperatorService, trainer: TrainerService | None,
                     options: tuple[tuple[str, Any], ...] = (), credentials: Any = None) -> None:
        """A started gRPC server on `address` with the Operator service, health, reflection and, if
        given, the Trainer service; OSError if the address will not bind."""
        assert self.grpc is not None
        services: list[Registration] = [(pb_grpc.add_OperatorServicer_to_server, operator),
                                        (health_pb2_grpc.add_HealthServicer_to_server, self.health)]
        if trainer is not None:
            services.append((pb_grpc.add_TrainerServicer_to_server, trainer))
        served = [n for n in SERVICES if trainer is not None or n != "zen.v1.Trainer"]
        self.grpc.serve(address, services, (*(pb.DESCRIPTOR.services_by_name[n.split(".")[-1]].full_name
                                              for n in served),
                                            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), options,
                        credentials)

    def _set_serving(self, serving: bool) -> None:
        """What the node state tells health (under its lock): SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse
        self._set_health(status.SERVING if serving else status.NOT_SERVING)

    def _set_health(self, status: Any) -> None:
        """Every service's health, set on the servers' loop (the servicer's own); nothing once they stopped."""
        servers = self.grpc
        if servers is None or not servers.loop.is_running():
            return

        async def set_all() -> None:
            for name in ("", *SERVICES):
                await self.health.set(name, status)

        asyncio.run_coroutine_threadsafe(set_all(), servers.loop).result(10.0)

    def _open_steps(self) -> None:
        """Admit steps again, run over the current data plane (at start, and after a new generation)."""
        s, m = self.settings, self.membership
        comm = self.transport if self.transport is not None else _Alone()
        self.trainer_steps.open(NodeSteps(self.metrics.counting(comm, m.members), s.step_timeout_s, m.generation))
        if self.checkpoints is not None and m.world_size > 1 and self.elastic is not None:
            self.checkpoints.new_generation(m.generation)  # every node forms it: a lost checkpoint comes back
        node = s.rank if s.rank >= 0 else m.rank  # --rank auto: the one the rendezvous gave
        self.metrics.set_node(node, self.transport_name, self.ucx_transports(), m.source.split(" ")[0], m.generation,
                              m.cluster_id)
        self.metrics.membership_changed.set(self.last_change[1])

    def _join_elastic(self, address: str, rank: int, world_size: int) -> Membership:
        """The first generation (--elastic 1): a store that does not answer, or a round that fails or times
        out (a member frozen while it formed), is tried again, with backoff and jitter, until it forms or
        the daemon is told to stop (Stopping); the node says why it is still joining in health and status."""
        s, backoff = self.settings, Backoff(first_s=1.0, cap_s=10.0)
        where = address
        while True:
            try:
                if self.elastic is None:
                    self.elastic = ElasticRendezvous(address, rank, world_size, s.listen, cluster_id=s.cluster_id,
                                                     agreed=s.agreed(), dead_after_s=s.peer_timeout_s,
                                                     timeout_s=s.connect_timeout_s, secret=self.secret,
                                                     min_nodes=s.min_nodes,
                                                     tls=RendezvousTls(s.rendezvous_tls_ca_file,
                                                                       s.rendezvous_tls_cert_file,
                                                                       s.rendezvous_tls_key_file))
                return self.elastic.join()
            except MembershipError as exc:
                wait_s = backoff.next()
                why = (f"the rendezvous at {where} has not formed a generation (attempt {backoff.attempts}: "
                       f"{first_line(exc)}); trying again in {wait_s:.1f} s")
                log.warning("rendezvous failed, retrying", extra={"event": "rendezvous_retry", "error": str(exc),
                                                                   "attempt": backoff.attempts, "wait_s": wait_s})
                self.node_state.apply(still_joining(why))
                if self._stop_requested.wait(wait_s):
                    raise Stopping("stopped while joining the cluster") from None

    def request_stop(self) -> None:
        """A signal's request: end a join that waits to try again (start raises Stopping); the caller then
        drains and stops."""
        self._stop_requested.set()

    def _find_membership(self) -> Membership:
        s = self.settings
        if s.rendezvous:  # "env" was resolved into HOST:PORT, rank and world size (settings.resolve)
            if s.elastic:  # HOST:PORT of a `zend store`, or etcd://... (round_store.py)
                m = self._join_elastic(s.rendezvous, s.rank, s.world_size)
                self.last_change = ("joined", time.time())
                self._learn_job_steps(m.job_steps)  # a restarted node learns where its jobs are
                return m
            host, _, port_text = s.rendezvous.rpartition(":")
            port, world_size, rank = int(port_text), s.world_size, s.rank
            return rendezvous(host, port, rank, world_size, s.listen, cluster_id=s.cluster_id, agreed=s.agreed(),
                              secret=self.secret, timeout_s=s.connect_timeout_s)
        if not s.peers:  # one node: no data plane
            return Membership(0, 1, {}, s.generation, s.cluster_id, s.agreed(), "static")
        return static_membership(s.rank, s.world_size, list(s.peers), cluster_id=s.cluster_id, agreed=s.agreed(),
                                 generation=s.generation)

    def _start_data_plane(self) -> None:
        m, s = self.membership, self.settings
        if m.world_size == 1:
            self.transport_name = "none"
            self.registry.watch_last_steps(None)
            return
        hosts = [parse_uri(u)[1] for _, u in sorted(m.peers.items())]
        backend, reason = choose_transport(s.transport, hosts)
        self.transport_name = backend
        log.info("transport chosen", extra={"event": "transport", "transport": backend, "reason": reason})
        engine, why = choose_engine(s.data_plane_engine, backend)
        self.engine_name = engine
        self.metrics.set_engine(engine)
        log.info(f"data-plane engine: {engine} ({why})", extra={"event": "engine", "engine": engine, "reason": why})
        _, host, port = parse_uri(s.listen or m.peers[m.rank])
        self.transport = create(f"{backend}://{host}:{port}", m.rank, m.world_size, engine=engine,
                                cluster_id=m.cluster_id, secret=self.secret, generation=m.generation,
                                timeout_s=s.peer_timeout_s, security=s.data_plane_security)
        registry, checkpoints = self.registry, self.checkpoints
        census_last = m.generation - 1 if checkpoints is not None else None  # one census per generation

        def last_step(key: str, tid: int) -> int | None:  # checkpoint tags are judged like a step's
            if tid == CKPT_TENSOR:
                return checkpoints.last_step(key) if checkpoints is not None else None
            if tid == CENSUS_TENSOR:
                return census_last if key == CENSUS_KEY else None
            return registry.last_step(key, tid)

        self.transport.admission = lambda src, kind, tag, size: admission.judge_frame(kind, tag, size, last_step)
        transport = self.transport
        watcher = transport.note_last_step if isinstance(transport, NativeTcpTransport) else None
        if isinstance(transport, NativeTcpTransport):  # the engine judges frames itself, from each tensor's
            transport.judge_in_engine(STEP_WINDOW, admission.MAX_AGREEMENT_BYTES)  # last step as told
        registry.watch_last_steps(watcher)
        if checkpoints is not None:
            checkpoints.watch_last_steps(watcher)
            if watcher is not None and census_last is not None:
                watcher(CENSUS_KEY, CENSUS_TENSOR, census_last)
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
        """Expire steps whose trainers never came, and sessions whose trainer never connected; health
        follows the data plane's listener."""
        while not self._stopped.wait(0.5):
            try:
                self._follow_accept()
                self.trainer_steps.expire()
                for s in self.registry.expire_unclaimed(self.settings.claim_timeout_s):
                    self._session_gone(s, logging.WARNING, "session expired: its trainer never connected the buffer "
                                       "socket", "session_expired", after_s=self.settings.claim_timeout_s)
            except Exception:  # one bad round must not end expiry for good
                log.exception("housekeeping")

    def _follow_accept(self) -> None:
        """NOT_SERVING while the data plane cannot accept connections (a peer that restarts could not get
        back in), SERVING again when it can and nothing else holds it down (node_state.py)."""
        transport = self.transport
        error = transport.accept_error if transport is not None else None
        if error != self.node_state.state.accept_error:
            self.node_state.apply(accept_recovered if error is None else accept_failed(error))

    # ------------------------------------------------------------------ a membership that changes
    # The moves of a generation change (generations.py decides when, and carries it out through these).
    def links_up(self) -> dict[int, bool]:
        """--rank -> whether this node's link to that member is up, for every other member."""
        transport, m = self.transport, self.membership
        members = m.members or tuple(range(m.world_size))
        return {members[p.rank]: p.connected for p in (transport.peer_states() if transport is not None else [])
                if p.rank < len(members)}

    def leave(self, reason: str) -> None:
        """Refuse new steps, abort this generation's (their links close at once rather than wait on a dead
        peer), remember where each job is, and forget what a new generation must agree on again."""
        self.node_state.apply(changing(reason))
        self.trainer_steps.close_node()
        self._drop_transport()
        self.trainer_steps.end_generation(reason, self.settings.step_timeout_s)
        self._learn_job_steps(self.registry.job_steps())  # what this node knew, for a node that knows nothing
        self.registry.new_generation(self.new_scheme)

    def connect(self, membership: Membership) -> None:
        self.membership = membership
        self._start_data_plane()

    def drop_links(self) -> None:
        self._drop_transport()

    # ------------------------------------------------------------------ where each job is
    # A job's step only moves forward; what a node learns of it (its generation's agreement, its tensors'
    # progress) is kept as the highest seen, never lowered by a node that knows less.
    def _learn_job_steps(self, steps: dict[str, int]) -> None:
        with self._steps_lock:
            for job, step in steps.items():
                if step > self.job_steps.get(job, -1):
                    self.job_steps[job] = step

    def _learn_tensor_step(self, key: StepKey) -> None:
        """A step this node found a tensor at elsewhere (a peer, or another trainer here, was at it)."""
        with self._steps_lock:
            if key.step > self.tensor_steps.get((key.job, key.tensor_id), -1):
                self.tensor_steps[(key.job, key.tensor_id)] = key.step

    def job_step(self, job: str) -> int:
        """The step `job` is at, as far as this node knows: what its generation agreed on, or else the lowest
        over its tensors of where each is known to be (its next step here, a step the node learned it is at
        elsewhere, a step its trainers here wait in): a trainer that joins a running generation resumes
        there, also after every daemon restarted."""
        reached = [(s.tensor_id, s.stats.last_step + 1) for s in self.registry.tensor_list()
                   if s.spec.job == job and s.stats.steps]
        with self._steps_lock:
            reached += [(tid, step) for (j, tid), step in self.tensor_steps.items() if j == job]
        reached += list(self.trainer_steps.open_steps_of(job).items())
        return where_the_job_is(self.job_steps.get(job, 0), reached)

    def tensor_step(self, job: str, tensor_id: int) -> int:
        """The step tensor `tensor_id` of `job` is at, as far as this node knows: job_step's sources for this one
        tensor (the step after its last one here, a step it was found at elsewhere, a step a trainer here waits
        in), and never below the step the generation agreed for the job (0 outside elastic clusters), which is
        all a tensor new to the job gets. A trainer that registers the tensor mid-job (every trainer of the job
        restarted on live daemons) steps from here."""
        try:
            stats = self.registry.tensor(job, tensor_id).stats
            reached = [stats.last_step + 1] if stats.steps else []
        except StepError:  # not registered (any more): nothing ran here
            reached = []
        with self._steps_lock:
            reached.append(self.tensor_steps.get((job, tensor_id), 0))
            agreed = self.job_steps.get(job, 0)
        reached.append(self.trainer_steps.open_steps_of(job).get(tensor_id, 0))
        return max(agreed, *reached)

    def still_changing(self, why: str) -> None:
        self.node_state.apply(changing(why))

    def resume(self, membership: Membership, why: str) -> None:
        self.last_change = (why, time.time())
        self._learn_job_steps(membership.job_steps)
        self._open_steps()
        self.node_state.apply(changed)

    def _drop_transport(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close()

    def not_whole(self) -> str | None:
        """Why this node cannot run steps now (the node state's reason, or a peer lost), or None (Ready)."""
        why = self.node_state.state.why_not_serving()
        if why is not None:
            return why
        transport = self.transport
        if self.membership.world_size > 1 and transport is None:
            return "the daemon is still joining its cluster"
        lost = [p for p in (transport.peer_states() if transport is not None else []) if not p.connected]
        if lost:
            return "; ".join(f"node {p.rank} lost" + (f": {p.error}" if p.error else "") for p in lost)
        return None

    # ------------------------------------------------------------------ what the node reports
    def _checkpoint_plane(self) -> DataPlane:
        """The generation a checkpoint replicates in: its communicator (None alone) and members."""
        m, t = self.membership, self.transport
        comm = self.metrics.counting(t, m.members) if t is not None and m.world_size > 1 else None
        return DataPlane(comm, m.generation, list(m.members) or list(range(m.world_size)))

    def readings(self) -> NodeReadings:
        """The levels Prometheus scrapes."""
        t = self.transport
        pool = t.pool_stats() if t is not None else None
        return NodeReadings(
            connected_trainers=self.registry.connected_trainers(), steps_in_flight=self.trainer_steps.in_flight(),
            buffer_pool_bytes=self.buffers.pool_bytes,
            receive_pool_bytes=pool.pooled_bytes if pool else 0,
            receive_pool_reuse_ratio=pool.reused / max(1, pool.reused + pool.allocated) if pool else 0.0,
            peer_up={self._node_of(p.rank): p.connected for p in t.peer_states()} if t is not None else {},
            state=self.node_state.state.name,
            checkpoint_bytes=self.checkpoints.held_bytes() if self.checkpoints is not None else 0)

    def _node_of(self, rank: int) -> int:
        """The --rank of the generation's member `rank` (they differ after an elastic scale-in)."""
        members = self.membership.members
        return members[rank] if 0 <= rank < len(members) else rank

    def status(self) -> NodeStatus:
        """The node as `zend status` shows it."""
        m, links = self.membership, {p.rank: p for p in (self.transport.peer_states() if self.transport else [])}
        down = PeerState(-1, connected=False, error=None)  # no data plane (yet)
        peers = tuple(PeerStatus(j, uri, links.get(j, down).connected, links.get(j, down).error or "")
                      for j, uri in sorted(m.peers.items()) if j != m.rank)
        sessions = tuple(SessionStatus(s.session_id[:8], s.job, s.local_rank, s.pid,
                                       self.buffers.session_bytes(s.session_id) if s.claimed else 0)
                         for s in self.registry.session_list())
        tensors = tuple(TensorStatus(t.spec.job, t.spec.name, t.tensor_id, t.spec.shape, t.spec.dtype_name,
                                     t.spec.layout, t.stats.scheme or self.settings.scheme, replace(t.stats))
                        for t in self.registry.tensor_list())
        return NodeStatus(m.rank, m.world_size, m.generation, m.cluster_id, m.source, self.transport_name,
                          tuple(self.ucx_transports()), self.trainer_steps.in_flight(), self.node_state.state.drained,
                          daemon_version(), self.buffers.pool_bytes, peers, sessions, tensors, *self.last_change,
                          data_plane_engine=self.engine_name, state=self.node_state.state.name,
                          state_reason=self.node_state.state.why_not_serving() or "",
                          checkpoints=self._checkpoint_status())

    def _checkpoint_segment(self, info: SessionInfo, body: dict[str, Any]) -> Any:
        """buffers.sock op: a read-only checkpoint segment of the caller's job, as a descriptor."""
        step, segment = body.get("step"), body.get("segment")
        if self.checkpoints is None:
            return wire.reply_error("this daemon keeps no checkpoints", codes.FAILED_PRECONDITION)
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(segment, str):
            return wire.reply_error(f"{SEGMENT_OP}: step must be an integer and segment a string, got "
                                    f"{step!r}, {segment!r}"[:200], codes.INVALID_ARGUMENT)
        try:
            nbytes, fd = self.checkpoints.segment(info.job, step, segment)
        except StepError as exc:
            return wire.reply_error(exc.message, exc.code)
        return wire.reply_ok(nbytes=nbytes), fd

    def _checkpoint_status(self) -> tuple[CheckpointStatus, ...]:
        held = self.checkpoints.job_status() if self.checkpoints is not None else []
        return tuple(CheckpointStatus(job, last, tuple(steps), nbytes) for job, last, steps, nbytes in held)

    # ------------------------------------------------------------------ sessions
    def _claim_session(self, session_id: str, token: str) -> SessionInfo | None:
        try:
            s = self.registry.claim(session_id, token)
        except StepError as exc:  # a wrong token: refused, the session stays its trainer's to claim
            raise ClaimRefused(exc.message) from None
        return None if s is None else SessionInfo(session_id, s.job)

    def end_session(self, session_id: str) -> None:
        s = self.registry.close_session(session_id)
        if s is not None:
            self._session_gone(s, logging.INFO, "session closed", "session_close")

    def _session_gone(self, s: Session, level: int, message: str, event: str, **extra: Any) -> None:
        """After a session left the registry: its partners' steps fail now, not at their deadline."""
        self.trainer_steps.session_closed(s)
        log.log(level, message, extra={"event": event, "job": s.job, "local_rank": s.local_rank, "pid": s.pid,
                                       **extra})

    def new_scheme(self) -> Scheme:
        s = self.settings
        return make_scheme(s.scheme, seed=s.hash_seed, min_slice_width=s.min_slice_width,
                           reprofile_every=s.reprofile_every)

    # ------------------------------------------------------------------ stopping
    def drain(self, timeout_s: float, final: bool = False) -> tuple[int, int]:
        """Refuse new steps and sessions; wait for the steps in flight. Returns (completed, abandoned).
        `final`: the drain before stopping (SIGTERM), which Undrain cannot undo."""
        self.node_state.apply(drain(final))  # refused before health says so: nothing new slips in between
        completed, abandoned = self.trainer_steps.wait_in_flight(timeout_s)
        log.info("drained", extra={"event": "drain", "completed": completed, "abandoned": abandoned})
        return completed, abandoned

    def undrain(self) -> tuple[bool, str]:
        """Undo a drain: admit steps and sessions again, and SERVING again unless the node is still joining
        or its membership is changing (it turns SERVING when that is over). Returns (serving, why not)."""
        try:
            state = self.node_state.apply(undrain)
        except TransitionRefused as exc:
            raise StepError(FAILED_PRECONDITION, str(exc)) from None
        why = state.why_not_serving()
        log.info("undrained", extra={"event": "undrain", "serving": why is None, "reason": why or ""})
        return why is None, why or ""

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.node_state.apply(stopping)
        if self.grpc is not None:
            self.grpc.stop(grace_s=1.0)
        self.buffers.close()
        if self.transport is not None:
            self.transport.close()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.elastic is not None:
            self.elastic.close()
        if os.path.exists(self.settings.grpc_socket):
            os.unlink(self.settings.grpc_socket)
        log.info("daemon stopped", extra={"event": "stopped"})

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)


def raise_descriptor_limit() -> None:
    """The soft limit on open descriptors up to the hard one: every trainer, buffer, peer link and
    listener connection takes one, and the common soft default (1024) is what a flood exhausts first."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit", extra={"event": "rlimit", "soft": soft, "hard": hard,
                                                                    "error": str(exc)})
    log.info("descriptor limit", extra={"event": "rlimit", "soft": soft, "hard": hard})


PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4  # <linux/prctl.h>


def make_undumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) on this process; OSError if it cannot be done.

    Every job's in-flight gradients sit in this process's memfds (mode 0600), and 0600 stops no
    process of the daemon's own uid: opening /proc/<pid>/fd/N or /proc/<pid>/mem is decided by the
    ptrace access check, which a same-uid process passes while the target is dumpable. Non-dumpable,
    /proc/<pid>/ belongs to root, so another job's trainer running as the same (non-root) uid gets
    EACCES there and reaches buffers only through buffers.sock, with its own session's token. It
    also keeps the cluster secret and gradients out of core dumps. The cost: no core dumps of the
    daemon, and gdb or py-spy on it need root (CAP_SYS_PTRACE). The daemon itself still reads its
    own /proc/self (the process metrics do).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)
    if libc.prctl(PR_SET_DUMPABLE, zero, zero, zero, zero) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot make the daemon non-dumpable (prctl PR_SET_DUMPABLE 0): {os.strerror(err)}")
    state = libc.prctl(PR_GET_DUMPABLE, zero, zero, zero, zero)
    if state != 0:
        raise OSError(f"the daemon is still dumpable after prctl(PR_SET_DUMPABLE, 0): PR_GET_DUMPABLE says {state}")


class _Alone(Communicator):
    """The data plane of a one-node cluster: nobody to talk to (schemes never call it)."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def send(self, dst: int, tag: str, payload: Any) -> None:
        raise RuntimeError("one-node cluster has no peers")

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> Any:
        raise RuntimeError("one-node cluster has no peers")
