"""The Operator gRPC service: the node's status (`zend status`) and drain, over a typed snapshot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from zend.api.zen.v1 import zen_pb2 as pb
from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
from zend.daemon.grpc_errors import maps_errors
from zend.daemon.status import NodeStatus
from zend.protocol.enums import DTYPE_TO_PROTO, LAYOUT_TO_PROTO


class OperatorService(pb_grpc.OperatorServicer):
    """Args:
        status: a snapshot of the node, taken per call.
        drain: drains the daemon for at most the given seconds; returns (completed, abandoned) steps.
        drain_timeout_s: the drain's bound when a request gives none.
        count_error: counts each error status answered.
    """

    def __init__(self, status: Callable[[], NodeStatus], drain: Callable[[float], tuple[int, int]],
                 drain_timeout_s: float, count_error: Callable[[str], None]):
        self.status, self.drain, self.drain_timeout_s, self.count_error = status, drain, drain_timeout_s, count_error

    @maps_errors
    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        return status_reply(self.status())

    @maps_errors
    def Drain(self, request: Any, context: grpc.ServicerContext) -> Any:
        completed, abandoned = self.drain(request.timeout_seconds or self.drain_timeout_s)
        return pb.DrainReply(completed=completed, abandoned=abandoned)


def status_reply(s: NodeStatus) -> Any:
    reply = pb.StatusReply(node_rank=s.node_rank, node_count=s.node_count, generation=s.generation,
                           cluster_id=s.cluster_id, membership=s.membership, transport=s.transport,
                           ucx_transports=list(s.ucx_transports), steps_in_flight=s.steps_in_flight,
                           draining=s.draining, daemon_version=s.daemon_version,
                           buffer_pool_bytes=s.buffer_pool_bytes, last_membership_change=s.last_membership_change,
                           last_membership_change_unix=s.last_membership_change_unix)
    for p in s.peers:
        reply.peers.add(rank=p.rank, address=p.address, connected=p.connected, error=p.error)
    for session in s.sessions:
        reply.sessions.add(session_id=session.session_id, job_id=session.job, local_rank=session.local_rank,
                           pid=session.pid, buffer_bytes=session.buffer_bytes)
    for t in s.tensors:
        st = t.stats
        reply.tensors.add(job_id=t.job, name=t.name, tensor_id=t.tensor_id, shape=list(t.shape),
                          dtype=DTYPE_TO_PROTO[t.dtype_name], layout=LAYOUT_TO_PROTO[t.layout], scheme=t.scheme,
                          last_step=st.last_step, steps=st.steps, last_sync_seconds=st.last_sync_seconds,
                          last_nnz_in=st.last_nnz_in, last_nnz_out=st.last_nnz_out, last_bytes_sent=st.last_bytes_sent,
                          last_push_imbalance=st.last_push_imbalance, last_pull_imbalance=st.last_pull_imbalance)
    return reply
