"""The Operator gRPC service: the node's status (`zend status`), drain and undrain, over a typed snapshot.

Every call but Status needs the operator token (`zend token --operator`) as gRPC metadata
`authorization: Bearer <operator token>`; Status without it answers the node-level fields only
(`redacted`: no job ids, tensor names, shapes, pids, peer addresses or errors). A token that is
given and wrong is UNAUTHENTICATED everywhere, Status included.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import grpc

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.grpc_errors import maps_errors
from zend.daemon.jobs import bearer_of
from zend.daemon.status import NodeStatus
from zend.protocol.enums import DTYPE_TO_PROTO, LAYOUT_TO_PROTO

log = logging.getLogger("zend.service")
MAX_STATUS_ROWS = 1000  # sessions and tensors listed per reply (counts are whole): the reply stays far below 4 MiB
HOW = "metadata 'authorization: Bearer <operator token>' (`zend token --operator`, from the cluster secret)"


class OperatorService(pb_grpc.OperatorServicer):
    """Args:
        status: a snapshot of the node, taken per call.
        drain: drains the daemon for at most the given seconds; returns (completed, abandoned) steps.
        undrain: admits steps again; returns (serving, why not).
        drain_timeout_s: the drain's bound when a request gives none.
        count_error: counts each error status answered.
        token: the operator token (jobs.operator_token of the cluster secret).
    """

    def __init__(self, status: Callable[[], NodeStatus], drain: Callable[[float], tuple[int, int]],
                 undrain: Callable[[], tuple[bool, str]], drain_timeout_s: float, count_error: Callable[[str], None],
                 token: str):
        self.status, self.drain, self.undrain = status, drain, undrain
        self.drain_timeout_s, self.count_error, self._token = drain_timeout_s, count_error, token

    def _operator(self, context: grpc.ServicerContext, what: str, required: bool) -> bool:
        """True when the caller presents the operator token; False when it presents none and `required`
        is False; else UNAUTHENTICATED, logged with the caller's address."""
        given = [v for k, v in context.invocation_metadata() if k == "authorization"]
        if not given and not required:
            return False
        token = bearer_of(given[0]) if given else None
        if token and hmac.compare_digest(token.encode(), self._token.encode()):
            return True
        why = "the token given is not the operator token" if given else "no operator token given"
        log.warning("operator call refused", extra={"event": "operator_unauthenticated", "call": what,
                                                    "peer": context.peer(), "reason": why})
        raise StepError(codes.UNAUTHENTICATED, f"{what}: {why}; it needs {HOW}")

    @maps_errors
    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        return status_reply(self.status(), full=self._operator(context, "Status", required=False))

    @maps_errors
    def Drain(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._operator(context, "Drain", required=True)
        log.info("drain asked", extra={"event": "drain_asked", "peer": context.peer()})
        completed, abandoned = self.drain(request.timeout_seconds or self.drain_timeout_s)
        return pb.DrainReply(completed=completed, abandoned=abandoned)

    @maps_errors
    def Undrain(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._operator(context, "Undrain", required=True)
        log.info("undrain asked", extra={"event": "undrain_asked", "peer": context.peer()})
        serving, why = self.undrain()
        return pb.UndrainReply(serving=serving, reason=why)


def status_reply(s: NodeStatus, full: bool = True) -> Any:
    """The Status reply; without `full`, only what names no job, tensor, process or address."""
    reply = pb.StatusReply(node_rank=s.node_rank, node_count=s.node_count, generation=s.generation,
                           cluster_id=s.cluster_id, membership=s.membership if full else s.membership.split(" ")[0],
                           transport=s.transport, ucx_transports=list(s.ucx_transports),
                           steps_in_flight=s.steps_in_flight, draining=s.draining, daemon_version=s.daemon_version,
                           buffer_pool_bytes=s.buffer_pool_bytes, last_membership_change=s.last_membership_change,
                           last_membership_change_unix=s.last_membership_change_unix, redacted=not full,
                           session_count=len(s.sessions), tensor_count=len(s.tensors),
                           data_plane_engine=s.data_plane_engine, state=s.state,
                           state_reason=s.state_reason if full else "")  # a reason may name an address
    if not full:
        for p in s.peers:
            reply.peers.add(rank=p.rank, connected=p.connected)
        return reply
    for p in s.peers:
        reply.peers.add(rank=p.rank, address=p.address, connected=p.connected, error=p.error)
    for session in s.sessions[:MAX_STATUS_ROWS]:
        reply.sessions.add(session_id=session.session_id, job_id=session.job, local_rank=session.local_rank,
                           pid=session.pid, buffer_bytes=session.buffer_bytes)
    for c in s.checkpoints[:MAX_STATUS_ROWS]:
        reply.checkpoints.add(job_id=c.job, last_complete_step=c.last_complete_step, steps=list(c.steps),
                              bytes=c.nbytes)
    for t in s.tensors[:MAX_STATUS_ROWS]:
        st = t.stats
        reply.tensors.add(job_id=t.job, name=t.name, tensor_id=t.tensor_id, shape=list(t.shape),
                          dtype=DTYPE_TO_PROTO[t.dtype_name], layout=LAYOUT_TO_PROTO[t.layout], scheme=t.scheme,
                          last_step=st.last_step, steps=st.steps, last_sync_seconds=st.last_sync_seconds,
                          last_nnz_in=st.last_nnz_in, last_nnz_out=st.last_nnz_out, last_bytes_sent=st.last_bytes_sent,
                          last_push_imbalance=st.last_push_imbalance, last_pull_imbalance=st.last_pull_imbalance)
    return reply
