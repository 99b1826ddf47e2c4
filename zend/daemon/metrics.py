"""The daemon's Prometheus series (prometheus-client, one registry per daemon), and who records them.

Steps are recorded by `record_step` as they finish; the node's levels (trainers connected, steps
in flight, pool sizes, peers up, the node's state) are read at scrape time by a collector from
`watch(readings)`, so no thread has to keep gauges fresh. The process (descriptors, memory, CPU)
and the interpreter are prometheus-client's own collectors on the same registry. Label sets stay
bounded: phases, schemes, states, status codes and peers are small fixed sets, and per-tensor
series are kept for at most `max_tensors` tensors, per-job series for at most `max_jobs` jobs
(others report as "other"). The training job is labelled `zen_job`: Prometheus reserves `job` for
the scrape job. Names follow Prometheus' conventions: base units, `_total` on counters, `_ratio`
on fractions.

Names are the operator's: a scrape that presents the operator token (`authorization: Bearer
<token>`, Prometheus' `authorization` in a scrape config) sees job and tensor names; any other sees
the same series with the job's key and the tensor's id in their place (what the data plane's tags
carry), so dashboards still tell tensors apart and nothing names a job to a stranger.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from zend.core.comm import Communicator
from zend.daemon import errors as codes
from zend.daemon import exposition
from zend.daemon.jobs import bearer_of, job_key, tensor_id
from zend.protocol.version import daemon_version

if TYPE_CHECKING:
    import torch

    from zend.daemon.node_steps import StepOutcome

# the phases of a step on this node: they add up to a step's time there, so sums over `phase` hold;
# the time a trainer waits on the daemon, end to end, is zen_step_duration_seconds
PHASES = ("wait", "local_sum", "agree", "exchange", "commit", "deliver")
# the node's states as zen_node_state shows them (node_state.py's phases, with an operator's drain apart)
STATES = ("joining", "serving", "changing", "draining", "stopping")
# the codes of a caller's mistake (zen_errors_total{cause="client"}): they do not page; every other code
# is a fault of a daemon, a peer or the network (cause="fault")
CLIENT_CODES = frozenset({codes.INVALID_ARGUMENT, codes.NOT_FOUND, codes.PERMISSION_DENIED,
                          codes.UNAUTHENTICATED, codes.FAILED_PRECONDITION, codes.RESOURCE_EXHAUSTED,
                          "ALREADY_EXISTS", "OUT_OF_RANGE", "CANCELLED", "UNIMPLEMENTED"})
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class NodeReadings:
    """The node's levels at one moment (what the scrape-time gauges show)."""

    connected_trainers: int = 0
    steps_in_flight: int = 0
    buffer_pool_bytes: int = 0
    receive_pool_bytes: int = 0
    receive_pool_reuse_ratio: float = 0.0
    peer_up: dict[int, bool] = field(default_factory=dict)
    state: str = "joining"  # one of STATES
    checkpoint_bytes: int = 0


# name, help, the NodeReadings field it shows
_LEVELS = (
    ("zen_connected_trainers", "Trainer sessions holding a buffer connection", "connected_trainers"),
    ("zen_steps_in_flight", "Steps opened and not finished", "steps_in_flight"),
    ("zen_buffer_pool_bytes", "Shared-buffer bytes allocated to trainers", "buffer_pool_bytes"),
    ("zen_receive_pool_bytes", "Capacity of the data plane's reused receive blocks", "receive_pool_bytes"),
    ("zen_receive_pool_reuse_ratio", "Share of pooled payloads that landed in a block used before",
     "receive_pool_reuse_ratio"),
    ("zen_checkpoint_bytes", "In-memory checkpoint bytes this daemon holds (its trainers' and replicas of its peers')",
     "checkpoint_bytes"),
)


class _LevelCollector(Collector):
    """The node's levels, read when Prometheus scrapes (zeros until the daemon is watched)."""

    def __init__(self) -> None:
        self.readings: Callable[[], NodeReadings] = NodeReadings

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(self.readings())

    @staticmethod
    def _families(now: NodeReadings | None) -> Iterator[GaugeMetricFamily]:
        for name, text, attribute in _LEVELS:
            family = GaugeMetricFamily(name, text)
            if now is not None:
                family.add_metric([], float(getattr(now, attribute)))
            yield family
        peers = GaugeMetricFamily("zen_peer_up", "1 while the data-plane link to a peer node (its --rank) is up",
                                  labels=["peer"])
        for peer, up in sorted((now.peer_up if now is not None else {}).items()):
            peers.add_metric([str(peer)], 1.0 if up else 0.0)
        yield peers
        states = GaugeMetricFamily("zen_node_state", "1 for the node's state now (joining, serving, changing "
                                   "generation, draining, stopping), 0 for the others", labels=["state"])
        for state in STATES:
            states.add_metric([state], 1.0 if now is not None and now.state == state else 0.0)
        yield states


class Redacted:
    """A registry as a scrape without the operator token sees it: every `zen_job` label is the job's
    key and every `tensor` label the tensor's id ("other" stays "other")."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            if any("zen_job" in sample.labels for sample in family.samples):
                family.samples = [sample._replace(labels=_opaque(sample.labels)) for sample in family.samples]
            yield family


def _opaque(labels: dict[str, str]) -> dict[str, str]:
    job, tensor = labels.get("zen_job", "other"), labels.get("tensor", "other")
    if (job, tensor) == ("other", "other"):  # the series past the bound (a job named "other" is redacted)
        return labels
    return {**labels, "zen_job": job_key(job), "tensor": str(tensor_id(job, tensor))}


class DaemonMetrics:
    def __init__(self, node: int, max_tensors: int = 64, max_jobs: int = 16):
        disable_created_metrics()  # a `_created` series per counter doubles the series and nothing reads them
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):  # process_open_fds, python_info, ...
            collector(registry=self.registry)
        self.max_tensors, self.max_jobs = max_tensors, max_jobs
        self._tensors: set[str] = set()
        self._jobs: set[str] = set()
        self._last_scheme: dict[tuple[str, str], str] = {}  # (job, tensor) -> the scheme of its last step
        self._lock = threading.Lock()
        r = self.registry
        self.sync_seconds = Histogram("zen_sync_duration_seconds",
                                      "Time of one step on this node, by phase (the phases add up to the step)",
                                      ["scheme", "phase"], buckets=BUCKETS, registry=r)
        self.step_seconds = Histogram("zen_step_duration_seconds",
                                      "One trainer's step in the daemon, end to end: from its submit to its result "
                                      "written into its buffer", ["scheme"], buckets=BUCKETS, registry=r)
        self.bytes_sent = Counter("zen_sent_bytes", "Data-plane payload bytes sent, by peer", ["peer"], registry=r)
        self.bytes_received = Counter("zen_received_bytes", "Data-plane payload bytes received, by peer", ["peer"],
                                      registry=r)
        self.dense_bytes = Counter("zen_dense_equivalent_bytes",
                                   "Bytes a dense ring allreduce would have sent for the same steps", registry=r)
        self.saved_bytes = Counter("zen_saved_bytes", "Dense-equivalent bytes minus bytes really sent", registry=r)
        self.steps = Counter("zen_tensor_steps", "Tensor-steps synchronised on this node (one per tensor and step; "
                             "a DDP step of k buckets counts k), by scheme", ["scheme"], registry=r)
        self.errors = Counter("zen_errors", "Failed requests and steps, by gRPC status code and cause (client: the "
                              "caller's mistake; fault: a daemon's, a peer's or the network's)", ["code", "cause"],
                              registry=r)
        self.job_step_seconds = Histogram("zen_job_step_duration_seconds",
                                          "One trainer's step in the daemon, end to end, by job", ["zen_job"],
                                          buckets=BUCKETS, registry=r)
        self.job_bytes_sent = Counter("zen_job_sent_bytes", "Data-plane payload bytes sent for a job's steps",
                                      ["zen_job"], registry=r)
        self.job_steps = Counter("zen_job_tensor_steps", "Tensor-steps synchronised on this node, by job",
                                 ["zen_job"], registry=r)
        per_tensor = ["zen_job", "tensor"]
        self.nnz_in = Gauge("zen_tensor_input_rows", "Non-zero rows this node contributed at the last step",
                            per_tensor, registry=r)
        self.nnz_out = Gauge("zen_tensor_output_rows", "Non-zero rows of the summed gradient at the last step",
                             per_tensor, registry=r)
        self.density = Gauge("zen_tensor_density_ratio", "Output non-zero rows / rows at the last step", per_tensor,
                             registry=r)
        self.densification = Gauge("zen_tensor_densification_ratio",
                                   "Output non-zero rows / mean input rows per node at the last step", per_tensor,
                                   registry=r)
        self.push_imbalance = Gauge("zen_push_imbalance_ratio",
                                    "Cluster push load imbalance at the last step (1 = even)", per_tensor, registry=r)
        self.pull_imbalance = Gauge("zen_pull_imbalance_ratio", "Cluster pull imbalance at the last step (1 = even)",
                                    per_tensor, registry=r)
        self.scheme = Gauge("zen_scheme_chosen", "1 for the scheme each tensor used at its last step",
                            [*per_tensor, "scheme"], registry=r)
        self.info = Gauge("zen_node_info", "Constant 1, labelled with what this daemon runs (node: its --rank)",
                          ["node", "transport", "ucx_transports", "membership", "cluster_id"], registry=r)
        self.generation = Gauge("zen_membership_generation", "Membership generation", registry=r)
        self.build_info = Gauge("zen_build_info", "Constant 1, labelled with the zend version and the data-plane "
                                "engine it runs (native or python)", ["version", "engine"], registry=r)
        self.set_engine("python")
        self.membership_changed = Gauge("zen_membership_last_change_timestamp_seconds",
                                        "Unix time this node's current generation formed (--elastic)", registry=r)
        self.checkpoint_last_step = Gauge("zen_checkpoint_last_complete_step",
                                          "Newest in-memory checkpoint step complete on this node, by job",
                                          ["zen_job"], registry=r)
        self.checkpoint_replication_seconds = Histogram(
            "zen_checkpoint_replication_seconds", "From a checkpoint step whole on this node to complete everywhere "
            "(offers, replicas, acknowledgement): the replication lag", buckets=(*BUCKETS, 120.0, 300.0), registry=r)
        self.checkpoint_failures = Counter("zen_checkpoint_failures", "Checkpoint steps that failed on this node",
                                           registry=r)
        self.checkpoint_restore_seconds = Histogram("zen_checkpoint_restore_seconds",
                                                    "One trainer's read of checkpoint objects from this daemon (a "
                                                    "copy, or locating the segments it then maps)",
                                                    buckets=BUCKETS, registry=r)
        self.checkpoint_recovery_seconds = Histogram(
            "zen_checkpoint_recovery_seconds", "A checkpoint this node had lost, recovered from a peer's copy when a "
            "generation formed (the census, from its start)", buckets=(*BUCKETS, 120.0, 300.0), registry=r)
        self.checkpoint_recovered_bytes = Counter("zen_checkpoint_recovered_bytes",
                                                  "Checkpoint bytes recovered from peers' copies", registry=r)
        self.checkpoint_restored_bytes = Counter("zen_checkpoint_restored_bytes",
                                                 "Checkpoint bytes copied to trainers", registry=r)
        self._levels = _LevelCollector()
        r.register(self._levels)

    # ------------------------------------------------------------------ what the daemon tells us
    def watch(self, readings: Callable[[], NodeReadings]) -> None:
        """Read the node's levels from `readings` at every scrape."""
        self._levels.readings = readings

    def set_node(self, node: int, transport: str, ucx_transports: list[str], membership: str,
                 generation: int, cluster_id: str = "zen") -> None:
        self.info.clear()  # one series: a new generation may change what it runs
        self.info.labels(str(node), transport, ",".join(ucx_transports), membership, cluster_id).set(1)
        self.generation.set(generation)

    def set_engine(self, engine: str) -> None:
        """The data-plane engine running now (engine_choice.py): one zen_build_info series."""
        self.build_info.clear()
        self.build_info.labels(daemon_version(), engine).set(1)

    def count_error(self, code: str) -> None:
        self.errors.labels(code=code, cause="client" if code in CLIENT_CODES else "fault").inc()

    def record_delivery(self, scheme: str, seconds: float) -> None:
        """One trainer's result written into its buffer."""
        self.sync_seconds.labels(scheme=scheme, phase="deliver").observe(seconds)

    def record_trainer_step(self, job: str, scheme: str, seconds: float) -> None:
        """One trainer's submit answered with its result in its buffer."""
        self.step_seconds.labels(scheme=scheme).observe(seconds)
        self.job_step_seconds.labels(self.job_label(job)).observe(seconds)

    def record_checkpoint(self, job: str, step: int, seconds: float | None) -> None:
        """A checkpoint step complete on this node after `seconds` of replication (None: it failed)."""
        if seconds is None:
            self.checkpoint_failures.inc()
            return
        self.checkpoint_replication_seconds.observe(seconds)
        self.checkpoint_last_step.labels(self.job_label(job)).set(step)

    def record_recovery(self, nbytes: int, seconds: float) -> None:
        self.checkpoint_recovery_seconds.observe(seconds)
        self.checkpoint_recovered_bytes.inc(nbytes)

    def record_restore(self, nbytes: int, seconds: float) -> None:
        self.checkpoint_restore_seconds.observe(seconds)
        self.checkpoint_restored_bytes.inc(nbytes)

    def record_step(self, job: str, tensor_name: str, outcome: StepOutcome) -> None:
        """A step of a tensor that succeeded on this node."""
        for phase, seconds in outcome.phases.items():
            self.sync_seconds.labels(scheme=outcome.scheme, phase=phase).observe(seconds)
        self.steps.labels(scheme=outcome.scheme).inc()
        job_label = self.job_label(job)
        self.job_steps.labels(job_label).inc()
        self.job_bytes_sent.labels(job_label).inc(outcome.bytes_sent)
        self.dense_bytes.inc(outcome.dense_bytes)
        self.saved_bytes.inc(max(0, outcome.dense_bytes - outcome.bytes_sent))
        labels = self.tensor_label(job, tensor_name)
        grad = outcome.grad
        self.nnz_in.labels(*labels).set(outcome.nnz_in)
        self.nnz_out.labels(*labels).set(grad.nnz)
        self.density.labels(*labels).set(grad.density)
        mean_in = outcome.mean_input_rows or outcome.nnz_in
        self.densification.labels(*labels).set(grad.nnz / mean_in if mean_in else 1.0)
        self.push_imbalance.labels(*labels).set(outcome.push_load_imbalance)
        self.pull_imbalance.labels(*labels).set(outcome.pull_imbalance)
        with self._lock:
            previous = self._last_scheme.get((job, tensor_name))
            self._last_scheme[(job, tensor_name)] = outcome.scheme
        if previous and previous != outcome.scheme:  # auto switched: one series at 1 per tensor
            self.scheme.labels(*labels, previous).set(0)
        self.scheme.labels(*labels, outcome.scheme).set(1)

    def tensor_label(self, job: str, name: str) -> tuple[str, str]:
        """(job, tensor) labels, or ("other", "other") past the bound."""
        key = f"{job}\0{name}"
        with self._lock:
            if key in self._tensors or len(self._tensors) < self.max_tensors:
                self._tensors.add(key)
                return job, name
        return "other", "other"

    def job_label(self, job: str) -> str:
        """The job's `zen_job` label, or "other" past the bound."""
        with self._lock:
            if job in self._jobs or len(self._jobs) < self.max_jobs:
                self._jobs.add(job)
                return job
        return "other"

    def counting(self, comm: Communicator, nodes: Sequence[int] = ()) -> Communicator:
        """`comm`, with its payload bytes counted per peer, labelled with the peer's --rank (`nodes[rank]`:
        the generation's members; ranks as they are when empty), as zen_peer_up and zen_node_info{node}."""
        return _CountingCommunicator(comm, self, nodes)

    def serve(self, host: str, port: int, operator_token: str | None = None,
              tls: exposition.TlsContext | None = None) -> None:
        """The exposition on http://host:port/ (https:// with `tls`; any path), bounded (exposition.py);
        names only for the operator token (see the module's docstring), none at all without one."""
        redacted = Redacted(self.registry)

        def named(authorization: str | None) -> bool:
            given = bearer_of(authorization)
            return bool(operator_token and given and hmac.compare_digest(given.encode(), operator_token.encode()))

        def render(with_names: bool, accept: str) -> tuple[bytes, str]:
            encoder, content_type = choose_encoder(accept)
            return encoder(self.registry if with_names else redacted), content_type

        exposition.serve(host, port, render, named, tls=tls)


class _CountingCommunicator(Communicator):
    def __init__(self, inner: Communicator, metrics: DaemonMetrics, nodes: Sequence[int] = ()):
        self.inner, self.metrics = inner, metrics
        self._peer = [str(n) for n in nodes] if nodes else [str(r) for r in range(inner.world_size)]
        self.rank, self.world_size, self.sends_copy = inner.rank, inner.world_size, inner.sends_copy
        # each peer's labelled counters, made at its first message: labels() costs a lock and a
        # dict lookup, and a step counts dozens of messages (the series are never removed)
        self._sent: dict[int, Any] = {}
        self._received: dict[int, Any] = {}

    def _count_sent(self, dst: int, payload: torch.Tensor) -> None:
        counter = self._sent.get(dst)
        if counter is None:
            counter = self._sent[dst] = self.metrics.bytes_sent.labels(peer=self._peer[dst])
        counter.inc(payload.numel() * payload.element_size())

    def _count_received(self, src: int, payload: torch.Tensor) -> None:
        counter = self._received.get(src)
        if counter is None:
            counter = self._received[src] = self.metrics.bytes_received.labels(peer=self._peer[src])
        counter.inc(payload.numel() * payload.element_size())

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        self.inner.send(dst, tag, payload)
        self._count_sent(dst, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        payload = self.inner.recv(src, tag, timeout_s)
        self._count_received(src, payload)
        return payload

    def exchange(self, sends: Sequence[tuple[int, str, torch.Tensor]], recvs: Sequence[tuple[int, str]],
                 timeout_s: float | None = None) -> list[torch.Tensor]:
        got = self.inner.exchange(sends, recvs, timeout_s)
        for dst, _, payload in sends:
            self._count_sent(dst, payload)
        for (src, _), payload in zip(recvs, got, strict=True):
            self._count_received(src, payload)
        return got

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        self.inner.abort(prefix, reason, code)

    def link_epoch(self, peer: int) -> int:
        return self.inner.link_epoch(peer)

    def wait_relinked(self, peer: int, timeout_s: float) -> bool:
        return self.inner.wait_relinked(peer, timeout_s)

    def stalled_since(self, since: float) -> float | None:
        return self.inner.stalled_since(since)

    def holds(self, src: int, prefix: str) -> bool:
        return self.inner.holds(src, prefix)

    def voided(self, prefix: str) -> bool:
        return self.inner.voided(prefix)
