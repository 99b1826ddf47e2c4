"""A real Prometheus server scrapes real daemons; the key series are queryable after a few steps."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.prometheus import PrometheusServer, prometheus_binary
from tests.helpers import poll_for, random_grad, run_all
from zend.daemon.jobs import job_key, tensor_id
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed

pytestmark = [pytest.mark.daemon, pytest.mark.skipif(prometheus_binary() is None,
                                reason="needs the prometheus server binary (Debian package 'prometheus'; "
                                       ".ci/run installs it)")]

KEY_SERIES = [
    "zen_step_duration_seconds_count > 0",
    'zen_build_info{version=~".+"} == 1',
    'zen_sync_duration_seconds_count{phase="exchange"} > 0',
    "zen_sent_bytes_total > 0",
    "zen_received_bytes_total > 0",
    "zen_dense_equivalent_bytes_total > 0",
    "zen_saved_bytes_total > 0",
    "zen_tensor_steps_total > 0",
    'zen_tensor_input_rows{zen_job="metrics",tensor="emb"} > 0',
    'zen_tensor_output_rows{zen_job="metrics",tensor="emb"} > 0',
    'zen_tensor_density_ratio{zen_job="metrics",tensor="emb"} > 0',
    'zen_tensor_densification_ratio{zen_job="metrics",tensor="emb"} >= 1',
    'zen_push_imbalance_ratio{zen_job="metrics",tensor="emb"} >= 1',
    'zen_pull_imbalance_ratio{zen_job="metrics",tensor="emb"} >= 1',
    'zen_scheme_chosen{zen_job="metrics",tensor="emb"} == 1',
    'zen_errors_total{code="NOT_FOUND",cause="client"} > 0',
    'zen_node_state{state="serving"} == 1',
    'zen_node_state{state="joining"} == 0',
    'zen_job_step_duration_seconds_count{zen_job="metrics"} >= 3',
    'zen_job_tensor_steps_total{zen_job="metrics"} >= 3',
    'zen_job_sent_bytes_total{zen_job="metrics"} > 0',
    "process_open_fds > 0",
    "process_max_fds > 0",
    "process_resident_memory_bytes > 0",
    'python_info{implementation="CPython"} == 1',
    "zen_peer_up == 1",
    "zen_connected_trainers",
    "zen_steps_in_flight",
    "zen_buffer_pool_bytes",
    "zen_receive_pool_bytes",
    "zen_receive_pool_reuse_ratio",
    'zen_node_info{transport="tcp"} == 1',
    "zen_membership_generation",
    "zen_membership_last_change_timestamp_seconds",
]


def test_prometheus_scrapes_every_key_series(fresh_cluster, tmp_path):
    c = fresh_cluster(2, extra=["--log-format", "text", "--scheme", "zen"])

    def trainer(node: int) -> None:
        with TrainerSession(c.socket_dir(node), "metrics", c.token("metrics"), 0, 1) as link:
            h = link.register("emb", (500, 8))
            for step in range(3):
                link.allreduce(h, random_grad(500, 8, 10 * step + node), step)
            with pytest.raises(StepFailed):  # one error, so the error series has data
                h.tensor_id += 1
                link.allreduce(h, random_grad(500, 8, 0), 9)

    assert all(r is None for r in run_all([lambda n=n: trainer(n) for n in range(2)]))
    targets = [f"127.0.0.1:{p}" for p in c.metrics_ports]
    with PrometheusServer(targets, tmp_path / "prom", scrape_interval_s=0.5, bearer_token=c.operator_token()) as prom:
        def scraped_from_both(expr: str) -> bool:
            instances = {r["metric"].get("instance") for r in prom.wait_for(expr, timeout_s=30)}
            assert instances == set(targets), f"{expr}: only {instances}"
            return True

        for expr in KEY_SERIES:  # until both daemons have been scraped
            poll_for(lambda e=expr: scraped_from_both(e), 30, f"{expr} from both daemons", interval_s=0.25,
                     ignore=(AssertionError,))

    # the phases of a step add up to it: with one trainer per node, their sums fall within the
    # trainers' end-to-end step time (submit to result delivered), and no "total" phase double-counts
    for port in c.metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
        # no token, no names: the job's key and the tensor's id stand in for them
        rows = {(s.labels["zen_job"], s.labels["tensor"]) for s in families["zen_tensor_input_rows"].samples}
        assert rows == {(job_key("metrics"), str(tensor_id("metrics", "emb")))}, rows
        samples = [s for f in families.values() for s in f.samples]
        assert not any(s.name.endswith("_created") for s in samples), "no _created series"
        phases = {s.labels["phase"]: s.value for s in families["zen_sync_duration_seconds"].samples
                  if s.name.endswith("_sum")}
        assert "total" not in phases and {"wait", "exchange", "deliver"} <= set(phases), phases
        step = sum(s.value for s in families["zen_step_duration_seconds"].samples if s.name.endswith("_sum"))
        steps = sum(s.value for s in families["zen_step_duration_seconds"].samples if s.name.endswith("_count"))
        assert steps == 3, steps  # the failed step is not one
        assert 0.5 * step <= sum(phases.values()) <= step * 1.02 + 0.005, (phases, step)
