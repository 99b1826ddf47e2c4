"""The daemon's registry (zend/daemon/metrics.py) as an operator reads it: process metrics, the node's
state, errors split by cause, bounded per-job series, and Prometheus' naming conventions."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zend.daemon import errors as codes
from zend.daemon import node_state as ns
from zend.daemon.metrics import CLIENT_CODES, STATES, DaemonMetrics, NodeReadings

pytestmark = pytest.mark.inprocess


def scrape(metrics: DaemonMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(metrics.registry).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_process_and_platform_metrics_are_on_the_daemons_registry() -> None:
    got = scrape(DaemonMetrics(0))
    for name in ("process_open_fds", "process_max_fds", "process_resident_memory_bytes",
                 "process_cpu_seconds_total", "process_start_time_seconds", "python_info"):
        assert name in got, f"{name} missing from the daemon's registry"
    assert got["process_open_fds"][0][1] > 0


@pytest.mark.parametrize("state", [ns.NodeState(),
                                   ns.joined(ns.NodeState()),
                                   ns.changing("a node joins")(ns.joined(ns.NodeState())),
                                   ns.drain()(ns.joined(ns.NodeState())),
                                   ns.stopping(ns.drain(final=True)(ns.joined(ns.NodeState())))],
                         ids=["joining", "serving", "changing", "draining", "stopping"])
def test_node_state_is_one_series_at_one(state: ns.NodeState) -> None:
    metrics = DaemonMetrics(0)
    metrics.watch(lambda: NodeReadings(state=state.name))
    series = {labels["state"]: value for labels, value in scrape(metrics)["zen_node_state"]}
    assert set(series) == set(STATES)
    assert [s for s, v in series.items() if v == 1.0] == [state.name]
    assert sum(series.values()) == 1.0


def test_errors_are_split_into_client_mistakes_and_faults() -> None:
    metrics = DaemonMetrics(0)
    for code in (codes.INVALID_ARGUMENT, codes.INVALID_ARGUMENT, codes.UNAUTHENTICATED, codes.UNAVAILABLE,
                 codes.ABORTED, codes.INTERNAL, codes.DEADLINE_EXCEEDED):
        metrics.count_error(code)
    errors = {(labels["code"], labels["cause"]): value for labels, value in scrape(metrics)["zen_errors_total"]}
    assert errors == {("INVALID_ARGUMENT", "client"): 2.0, ("UNAUTHENTICATED", "client"): 1.0,
                      ("UNAVAILABLE", "fault"): 1.0, ("ABORTED", "fault"): 1.0, ("INTERNAL", "fault"): 1.0,
                      ("DEADLINE_EXCEEDED", "fault"): 1.0}
    assert codes.UNAVAILABLE not in CLIENT_CODES and codes.INVALID_ARGUMENT in CLIENT_CODES


def test_per_job_series_are_bounded() -> None:
    metrics = DaemonMetrics(0, max_jobs=3)
    for i in range(10):
        metrics.record_trainer_step(f"job{i}", "zen", 0.01)
    jobs = {labels["zen_job"] for labels, _ in scrape(metrics)["zen_job_step_duration_seconds_count"]}
    assert jobs == {"job0", "job1", "job2", "other"}
    counts = {labels["zen_job"]: value for labels, value in scrape(metrics)["zen_job_step_duration_seconds_count"]}
    assert counts["other"] == 7.0 and counts["job0"] == 1.0


def test_names_follow_prometheus_conventions() -> None:
    """Counters end in _total, fractions in _ratio, times in _seconds, sizes in _bytes (base units)."""
    metrics = DaemonMetrics(0)
    metrics.count_error(codes.INTERNAL)
    metrics.record_trainer_step("job", "zen", 0.01)
    text = generate_latest(metrics.registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    zen = {name: kind for name, kind in types.items() if name.startswith("zen_")}
    assert zen, "no zen_ families"
    for name, kind in zen.items():
        if kind == "histogram":
            assert name.endswith("_seconds"), f"{name}: a histogram of times, in seconds"
        help_line = re.search(rf"^# HELP {name} (.*)$", text, re.M)
        assert help_line, name
        lowered = help_line.group(1).lower()
        if "imbalance" in name or "density" in name or "densification" in name:
            assert name.endswith("_ratio"), f"{name}: a fraction is named _ratio"
        if "milliseconds" in lowered or name.endswith(("_ms", "_millis")):
            pytest.fail(f"{name}: times are in seconds")
    for family in text_string_to_metric_families(text):
        if family.type == "counter" and family.name.startswith("zen_"):
            assert all(s.name.endswith("_total") for s in family.samples), family.name


def test_node_info_is_one_series_and_peers_are_named_by_their_node_rank() -> None:
    """After an elastic scale-in (members 0, 1, 3) the peer at generation rank 2 is node 3 in every series,
    as zen_node_info{node} and the alerts' lost_node name it; a new generation leaves one zen_node_info."""
    import torch

    from zend.transport.inproc import InProcessCluster

    metrics = DaemonMetrics(0)
    metrics.set_node(0, "tcp", [], "elastic", 1, "zen-a")
    metrics.set_node(0, "tcp", [], "elastic", 2, "zen-a")
    metrics.set_node(0, "ucx", ["rc"], "elastic", 3, "zen-a")
    info = scrape(metrics)["zen_node_info"]
    assert [labels for labels, _ in info] == [{"node": "0", "transport": "ucx", "ucx_transports": "rc",
                                               "membership": "elastic", "cluster_id": "zen-a"}]
    cluster = InProcessCluster(3)
    comms = [metrics.counting(cluster.communicator(r), nodes=(0, 1, 3)) for r in range(3)]
    comms[0].send(2, "t", torch.zeros(8, dtype=torch.uint8))
    comms[2].recv(0, "t", 5.0)
    sent = {labels["peer"]: value for labels, value in scrape(metrics)["zen_sent_bytes_total"]}
    assert sent == {"3": 8.0}
