"""The gRPC control plane: Trainer and Operator services over the node's step engine.

Only metadata crosses here; gradient bytes stay in shared buffers. Every StepError becomes
its gRPC status with its message; anything unexpected becomes INTERNAL and is logged, and
the daemon keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.core.sparse import SparseGradError
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import Session
from zend.daemon.tensors import DTYPES, TensorSpec

if TYPE_CHECKING:
    from zend.daemon.server import Daemon

log = logging.getLogger("zend.service")
T = TypeVar("T")

DTYPE_NAMES = {pb.DType.Value(name.upper()): name for name in DTYPES}  # FLOAT32 -> "float32", ...
DTYPE_ENUMS = {v: k for k, v in DTYPE_NAMES.items()}
LAYOUT_NAMES = {pb.SPARSE_ROWS: "sparse_rows", pb.DENSE: "dense"}
LAYOUT_ENUMS = {v: k for k, v in LAYOUT_NAMES.items()}
VERSION = "0.1.0"


def bearer_token(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    raise StepError(codes.UNAUTHENTICATED, "missing 'authorization: Bearer <job token>' metadata")


class Guard:
    """Runs a handler; StepError -> its status, anything else -> INTERNAL (logged)."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon

    def __call__(self, context: grpc.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StepError as exc:
            self.daemon.metrics.errors.labels(code=exc.code).inc()
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        except Exception as exc:
            self.daemon.metrics.errors.labels(code=codes.INTERNAL).inc()
            log.exception("internal error in %s", what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what}: internal error {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: abort raises")


class TrainerService(pb_grpc.TrainerServicer):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.guard = Guard(daemon)

    def _session(self, context: grpc.ServicerContext, session_id: str) -> Session:
        reg = self.daemon.registry
        s = reg.sessions.get(session_id)
        if s is None:
            raise StepError(codes.NOT_FOUND, f"session {session_id[:12]!r} is not open on this daemon")
        reg.check_token(s.job, bearer_token(context))
        return s

    def OpenSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        def run() -> Any:
            d = self.daemon
            d.registry.check_token(request.job_id, bearer_token(context))
            if d.node.draining:
                raise StepError(codes.UNAVAILABLE, "the daemon is draining: no new sessions")
            s = d.registry.open_session(request.job_id, request.local_rank, request.local_world_size, request.pid)
            log.info("session opened", extra={"event": "session_open", "job": s.job, "local_rank": s.local_rank,
                                              "pid": s.pid})
            m = d.membership
            return pb.OpenSessionReply(session_id=s.session_id, buffer_socket=d.settings.buffer_socket,
                                       node_rank=m.rank, node_count=m.world_size, generation=m.generation,
                                       daemon_version=VERSION)
        return self.guard(context, "OpenSession", run)

    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        def run() -> Any:
            self.daemon.end_session(self._session(context, request.session_id).session_id)
            return pb.CloseSessionReply()
        return self.guard(context, "CloseSession", run)

    def RegisterTensor(self, request: Any, context: grpc.ServicerContext) -> Any:
        def run() -> Any:
            s = self._session(context, request.session_id)
            if request.dtype not in DTYPE_NAMES:
                raise StepError(codes.INVALID_ARGUMENT, f"tensor {request.name!r}: dtype {request.dtype} is not one "
                                                        f"of {sorted(DTYPE_NAMES)} (FLOAT32, FLOAT16, BFLOAT16)")
            if request.layout not in LAYOUT_NAMES:
                raise StepError(codes.INVALID_ARGUMENT, f"tensor {request.name!r}: layout {request.layout} is not "
                                                        "SPARSE_ROWS or DENSE")
            try:
                spec = TensorSpec(s.job, request.name, tuple(request.shape), DTYPE_NAMES[request.dtype],
                                  LAYOUT_NAMES[request.layout], request.average)
            except SparseGradError as exc:
                raise StepError(codes.INVALID_ARGUMENT, str(exc)) from None
            state = self.daemon.registry.register(s, spec, self.daemon.new_scheme)
            return pb.RegisterTensorReply(tensor_id=state.tensor_id, scheme=self.daemon.settings.scheme,
                                          max_result_bytes=spec.max_bytes)
        return self.guard(context, "RegisterTensor", run)

    def Submit(self, request: Any, context: grpc.ServicerContext) -> Any:
        def run() -> Any:
            s = self._session(context, request.session_id)
            left = context.time_remaining()
            wait_s = self.daemon.settings.step_timeout_s if left is None else max(0.0, left - 0.05)
            out = self.daemon.node.submit(s, request.tensor_id, request.step,
                                          (request.input.buffer_id, request.input.offset), request.nnz,
                                          (request.result.buffer_id, request.result.offset), wait_s)
            return pb.SubmitReply(nnz=out.grad.nnz, scheme=out.scheme, bytes_sent=out.bytes_sent,
                                  bytes_received=out.bytes_received, dense_bytes=out.dense_bytes,
                                  phases=[pb.PhaseSeconds(phase=k, seconds=v) for k, v in out.phases.items()])
        return self.guard(context, "Submit", run)


class OperatorService(pb_grpc.OperatorServicer):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.guard = Guard(daemon)

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.guard(context, "Status", lambda: status_reply(self.daemon))

    def Drain(self, request: Any, context: grpc.ServicerContext) -> Any:
        def run() -> Any:
            timeout = request.timeout_seconds or self.daemon.settings.drain_timeout_s
            completed, abandoned = self.daemon.drain(timeout)
            return pb.DrainReply(completed=completed, abandoned=abandoned)
        return self.guard(context, "Drain", run)


def status_reply(d: Daemon) -> Any:
    m = d.membership
    reply = pb.StatusReply(node_rank=m.rank, node_count=m.world_size, generation=m.generation,
                           cluster_id=m.cluster_id, membership=m.source, transport=d.transport_name,
                           ucx_transports=d.ucx_transports(), steps_in_flight=d.node.table.in_flight(),
                           draining=d.node.draining, daemon_version=VERSION,
                           buffer_pool_bytes=d.buffers.pool_bytes if d.buffers else 0)
    for j, uri in sorted(m.peers.items()):
        if j == m.rank:
            continue
        peer = d.transport.peers[j] if d.transport is not None else None
        reply.peers.add(rank=j, address=uri, connected=peer is not None and peer.link is not None,
                        error=(peer.error or "") if peer is not None else "")
    for s in list(d.registry.sessions.values()):
        reply.sessions.add(session_id=s.session_id[:8], job_id=s.job, local_rank=s.local_rank, pid=s.pid,
                           buffer_bytes=d.buffers.session_bytes(s.session_id) if d.buffers and s.claimed else 0)
    for state in list(d.registry.tensors.values()):
        spec, st = state.spec, state.stats
        reply.tensors.add(job_id=spec.job, name=spec.name, tensor_id=state.tensor_id, shape=list(spec.shape),
                          dtype=DTYPE_ENUMS[spec.dtype_name], layout=LAYOUT_ENUMS[spec.layout],
                          scheme=st.get("scheme", d.settings.scheme), last_step=st.get("last_step", 0),
                          steps=st.get("steps", 0), last_sync_seconds=st.get("last_sync_seconds", 0.0),
                          last_nnz_in=st.get("last_nnz_in", 0), last_nnz_out=st.get("last_nnz_out", 0),
                          last_bytes_sent=st.get("last_bytes_sent", 0),
                          last_push_imbalance=st.get("last_push_imbalance", 0.0),
                          last_pull_imbalance=st.get("last_pull_imbalance", 0.0))
    return reply

