"""Asking a daemon whether it serves: the standard grpc.health.v1 check, overall service "".

The daemon answers NOT_SERVING until every peer is connected and again once it drains;
probes (`zend health`, Kubernetes, docker's HEALTHCHECK) and LocalCluster read it.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from zend.protocol.operator_channel import OperatorChannelTls, operator_channel


def health_status(address: str, timeout_s: float, tls: OperatorChannelTls | None = None) -> str:
    """The daemon's overall status ("SERVING", "NOT_SERVING", ...); grpc.RpcError if nobody answers."""
    with operator_channel(address, tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=timeout_s)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
