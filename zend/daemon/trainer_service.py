"""The Trainer gRPC service: sessions, tensors and steps, as the node's trainers ask for them.

Only metadata crosses here; gradient bytes stay in shared buffers. Every call presents the
job's token; a session only reaches its own job's tensors. The server is grpc.aio (grpc_server.py):
the short calls run on its handler threads, while Submit and Ready are coroutines that wait on
the event loop, so that no number of waiting steps can take the threads another job, or a
health probe, needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.core.schemes import Scheme
from zend.core.sparse import SparseGradError
from zend.daemon import errors as codes
from zend.daemon.checkpoint_keeper import CheckpointKeeper, ObjectRef
from zend.daemon.errors import StepError
from zend.daemon.grpc_errors import maps_errors
from zend.daemon.jobs import JobRegistry, Session, bearer_of
from zend.daemon.membership import Membership
from zend.daemon.trainer_steps import TrainerSteps
from zend.protocol.enums import DTYPE_FROM_PROTO, LAYOUT_FROM_PROTO
from zend.protocol.layout import TensorSpec
from zend.protocol.step import StepRequest
from zend.protocol.version import daemon_version

MAX_READY_WAIT_S = 30.0  # one Ready call waits at most this long; clients call again
READY_POLL_S = 0.05
log = logging.getLogger("zend.service")


def bearer_token(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata():
        token = bearer_of(value) if key == "authorization" else None
        if token is not None:
            return token
    raise StepError(codes.UNAUTHENTICATED, "missing 'authorization: Bearer <job token>' metadata")


class TrainerService(pb_grpc.TrainerServicer):
    """Args:
        registry: jobs, sessions and tensors (and the tokens that reach them).
        trainer_steps: the node's steps as its trainers see them.
        membership: the node's current membership (it is found after the service starts).
        buffer_socket: the path trainers claim their session on.
        new_scheme: a scheme object for a newly registered tensor.
        end_session: what the daemon does when a trainer closes its session.
        step_timeout_s: how long a Submit without a deadline waits.
        count_error: counts each error status answered.
        not_whole: why the node's membership is not whole now (None when it is); quick, it is polled.
        job_step: the step a job was at when the current generation formed (0 if unknown).
        checkpoints: the node's in-memory checkpoints (None: a daemon without them).
        tensor_step: (job, tensor id) -> the step that tensor is at on this node (0 if new to the job).
    """

    def __init__(self, registry: JobRegistry, trainer_steps: TrainerSteps, membership: Callable[[], Membership],
                 buffer_socket: str, new_scheme: Callable[[], Scheme], end_session: Callable[[str], None],
                 step_timeout_s: float, count_error: Callable[[str], None],
                 not_whole: Callable[[], str | None] = lambda: None,
                 job_step: Callable[[str], int] = lambda job: 0, checkpoints: CheckpointKeeper | None = None,
                 tensor_step: Callable[[str, int], int] = lambda job, tensor_id: 0):
        self.registry, self.trainer_steps, self.membership = registry, trainer_steps, membership
        self.buffer_socket, self.new_scheme, self.end_session = buffer_socket, new_scheme, end_session
        self.step_timeout_s, self.count_error = step_timeout_s, count_error
        self.not_whole, self.job_step, self.tensor_step = not_whole, job_step, tensor_step
        self.checkpoints = checkpoints
        self.record_restore: Callable[[int, float], None] | None = None  # metrics: (bytes, seconds) of a read

    def _session(self, context: grpc.ServicerContext, session_id: str) -> Session:
        """The open session, if the caller holds its job's token (an unknown session is NOT_FOUND first)."""
        s = self.registry.session(session_id)
        self.registry.check_token(s.job, bearer_token(context))
        return s

    @maps_errors
    async def OpenSession(self, request: Any, context: Any) -> Any:
        """Opened on a handler thread; if the reply never reaches the trainer (it went away, its deadline
        passed), the session is closed at once, not left holding its local rank until it expires."""
        token = bearer_token(context)

        def open_session() -> Session:
            self.registry.check_token(request.job_id, token)
            self.trainer_steps.check_accepting("sessions")
            s = self.registry.open_session(request.job_id, request.local_rank, request.local_world_size,
                                           request.pid)
            if self.checkpoints is not None:  # its peers' checkpoint traffic is taken from now on
                self.checkpoints.note_job(s.job)
            return s

        opening = asyncio.get_running_loop().run_in_executor(None, open_session)
        try:
            s = await asyncio.shield(opening)
        except asyncio.CancelledError:  # the trainer went away while it was being opened
            opening.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self._unanswered(f.result()))
            raise
        closed: list[bool] = []

        def unanswered(done: Any) -> None:
            if done.cancelled() and not closed:
                closed.append(True)
                self._unanswered(s)

        context.add_done_callback(unanswered)
        unanswered(context)  # over already (its deadline passed while it was opened): no callback comes
        log.info("session opened", extra={"event": "session_open", "job": s.job, "local_rank": s.local_rank,
                                          "pid": s.pid})
        m = self.membership()
        return pb.OpenSessionReply(session_id=s.session_id, buffer_socket=self.buffer_socket, node_rank=m.rank,
                                   node_count=m.world_size, generation=m.generation, daemon_version=daemon_version(),
                                   job_step=self.job_step(s.job))

    def _unanswered(self, s: Session) -> None:
        log.info("session closed: its OpenSession reply did not reach the trainer", extra={
            "event": "session_unanswered", "job": s.job, "local_rank": s.local_rank, "pid": s.pid})
        self.end_session(s.session_id)

    @maps_errors
    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.end_session(self._session(context, request.session_id).session_id)
        return pb.CloseSessionReply()

    @maps_errors
    def RegisterTensor(self, request: Any, context: grpc.ServicerContext) -> Any:
        s = self._session(context, request.session_id)
        if request.dtype not in DTYPE_FROM_PROTO:
            raise StepError(codes.INVALID_ARGUMENT, f"tensor {request.name!r}: dtype {request.dtype} is not one "
                                                    f"of {sorted(DTYPE_FROM_PROTO)} (FLOAT32, FLOAT16, BFLOAT16)")
        if request.layout not in LAYOUT_FROM_PROTO:
            raise StepError(codes.INVALID_ARGUMENT, f"tensor {request.name!r}: layout {request.layout} is not "
                                                    "SPARSE_ROWS or DENSE")
        try:
            spec = TensorSpec(s.job, request.name, tuple(request.shape), DTYPE_FROM_PROTO[request.dtype],
                              LAYOUT_FROM_PROTO[request.layout], request.average)
        except SparseGradError as exc:
            raise StepError(codes.INVALID_ARGUMENT, str(exc)) from None
        state = self.registry.register(s, spec, self.new_scheme)
        return pb.RegisterTensorReply(tensor_id=state.tensor_id, scheme=state.scheme.name,
                                      max_result_bytes=spec.max_bytes,
                                      next_step=self.tensor_step(s.job, state.tensor_id))

    @maps_errors
    async def Submit(self, request: Any, context: Any) -> Any:
        """A thin adapter to the daemon's one step entry (zend.protocol.step), on the event loop."""
        s = self._session(context, request.session_id)
        left = context.time_remaining()
        step = StepRequest.from_proto(request, self.step_timeout_s if left is None else left)
        return (await self.trainer_steps.step_async(s, step)).to_proto()

    @maps_errors
    async def Ready(self, request: Any, context: Any) -> Any:
        s = self._session(context, request.session_id)
        left = context.time_remaining()
        timeout_s = min(max(0.0, request.timeout_seconds), MAX_READY_WAIT_S,
                        MAX_READY_WAIT_S if left is None else left - 0.05)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while (why := self.not_whole() or self.trainer_steps.vacancy(s.job)) is not None \
                and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
        m = self.membership()
        return pb.ReadyReply(ready=why is None, generation=m.generation, node_count=m.world_size, reason=why or "",
                             job_step=self.job_step(s.job))

    # ------------------------------------------------------------------ in-memory checkpoints
    def _keeper(self) -> CheckpointKeeper:
        if self.checkpoints is None:
            raise StepError(codes.FAILED_PRECONDITION, "this daemon keeps no checkpoints (--checkpoint-memory-bytes 0)")
        return self.checkpoints

    @maps_errors
    def PutCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Any:
        s = self._session(context, request.session_id)
        held = self._keeper().put(s, request.step, request.buffer_id, _objects(request.objects), request.rank,
                                  request.world_size, request.coordinator, request.done)
        return pb.PutCheckpointReply(job_bytes=held)

    @maps_errors
    def ListCheckpoints(self, request: Any, context: grpc.ServicerContext) -> Any:
        s = self._session(context, request.session_id)
        return pb.ListCheckpointsReply(checkpoints=[
            pb.CheckpointInfo(step=c.step, state=c.state, bytes=c.nbytes, metadata_length=c.metadata_length,
                              reason=c.reason, holders=list(c.holders))
            for c in self._keeper().summaries(s.job)])

    @maps_errors
    def ReadCheckpoint(self, request: Any, context: grpc.ServicerContext) -> Any:
        s = self._session(context, request.session_id)
        started = time.perf_counter()
        if request.locate:  # the trainer maps the segments itself: counted here as located
            places = self._keeper().locate(s, request.step, [o.key for o in request.objects])
            if self.record_restore is not None:
                self.record_restore(sum(p[3] for p in places), time.perf_counter() - started)
            return pb.ReadCheckpointReply(places=[
                pb.CheckpointPlace(key=k, segment=seg, offset=off, length=n, segment_bytes=size)
                for k, seg, off, n, size in places])
        nbytes = self._keeper().read(s, request.step, request.buffer_id, _objects(request.objects))
        if self.record_restore is not None:
            self.record_restore(nbytes, time.perf_counter() - started)
        return pb.ReadCheckpointReply()


def _objects(objects: Any) -> list[ObjectRef]:
    return [ObjectRef(o.key, o.offset, o.length) for o in objects]
