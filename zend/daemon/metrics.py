"""The daemon's Prometheus series (prometheus-client, one registry per daemon).

Label sets stay bounded: phases, schemes, status codes and peers are small fixed sets, and
per-tensor series are kept for at most `max_tensors` tensors (others report as "other").
The training job is labelled `zen_job`: Prometheus reserves `job` for the scrape job.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PHASES = ("wait", "local_sum", "agree", "exchange", "deliver", "total")
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class DaemonMetrics:
    def __init__(self, node: int, max_tensors: int = 64):
        self.registry = CollectorRegistry()
        self.max_tensors = max_tensors
        self._tensors: set[str] = set()
        self._lock = threading.Lock()
        r = self.registry
        self.sync_seconds = Histogram("zen_sync_duration_seconds", "Time of one step on this node, by phase",
                                      ["scheme", "phase"], buckets=BUCKETS, registry=r)
        self.bytes_sent = Counter("zen_sent_bytes", "Data-plane payload bytes sent, by peer", ["peer"], registry=r)
        self.bytes_received = Counter("zen_received_bytes", "Data-plane payload bytes received, by peer", ["peer"],
                                      registry=r)
        self.dense_bytes = Counter("zen_dense_equivalent_bytes",
                                   "Bytes a dense ring allreduce would have sent for the same steps", registry=r)
        self.saved_bytes = Counter("zen_saved_bytes", "Dense-equivalent bytes minus bytes really sent", registry=r)
        self.steps = Counter("zen_steps", "Steps synchronised, by scheme", ["scheme"], registry=r)
        self.errors = Counter("zen_errors", "Failed requests and steps, by gRPC status code", ["code"], registry=r)
        self.nnz_in = Gauge("zen_tensor_input_rows", "Non-zero rows this node contributed at the last step",
                            ["zen_job", "tensor"], registry=r)
        self.nnz_out = Gauge("zen_tensor_output_rows", "Non-zero rows of the summed gradient at the last step",
                             ["zen_job", "tensor"], registry=r)
        self.density = Gauge("zen_tensor_density", "Output non-zero rows / rows at the last step",
                             ["zen_job", "tensor"],
                             registry=r)
        self.densification = Gauge("zen_tensor_densification",
                                   "Output non-zero rows / mean input rows per node at the last step",
                                   ["zen_job", "tensor"], registry=r)
        self.push_imbalance = Gauge("zen_push_imbalance", "Cluster push load imbalance at the last step (1 = even)",
                                    ["zen_job", "tensor"], registry=r)
        self.pull_imbalance = Gauge("zen_pull_imbalance", "Cluster pull imbalance at the last step (1 = even)",
                                    ["zen_job", "tensor"], registry=r)
        self.scheme = Gauge("zen_scheme_chosen", "1 for the scheme each tensor used at its last step",
                            ["zen_job", "tensor", "scheme"], registry=r)
        self.trainers = Gauge("zen_connected_trainers", "Trainer sessions holding a buffer connection", registry=r)
        self.in_flight = Gauge("zen_steps_in_flight", "Steps opened and not finished", registry=r)
        self.pool_bytes = Gauge("zen_buffer_pool_bytes", "Shared-buffer bytes allocated to trainers", registry=r)
        self.receive_pool_bytes = Gauge("zen_receive_pool_bytes",
                                        "Capacity of the data plane's reused receive blocks", registry=r)
        self.receive_pool_reuse = Gauge("zen_receive_pool_reuse_ratio",
                                        "Share of pooled payloads that landed in a block used before", registry=r)
        self.peer_up = Gauge("zen_peer_up", "1 while the data-plane link to a peer node is up", ["peer"], registry=r)
        self.info = Gauge("zen_node_info", "Constant 1, labelled with what this daemon runs",
                          ["node", "transport", "ucx_transports", "membership"], registry=r)
        self.generation = Gauge("zen_membership_generation", "Membership generation", registry=r)

    def tensor_label(self, job: str, name: str) -> tuple[str, str]:
        """(job, tensor) labels, or ("other", "other") past the bound."""
        key = f"{job}\0{name}"
        with self._lock:
            if key in self._tensors or len(self._tensors) < self.max_tensors:
                self._tensors.add(key)
                return job, name
        return "other", "other"

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)
