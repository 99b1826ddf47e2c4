"""Every scheme over real processes and real sockets: n = 4 ranks on loopback and in the emulated cluster."""

from __future__ import annotations

import pytest

from tests.transport.conftest import RankProcesses, call_all
from zend.cluster.netns import EmulatedCluster

SCHEMES = ["zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto"]


def run_cluster(processes: RankProcesses, n: int, cluster: EmulatedCluster | None = None) -> list[dict]:
    ranks = processes.mesh(n, cluster=cluster)
    return [a["report"] for a in call_all(ranks, "schemes", wait_s=120, names=SCHEMES)]


def check(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        assert set(report) == set(SCHEMES)
        for name, r in report.items():
            assert r["max_error"] < 1e-3, (rank, name, r)
            assert r["bytes_sent"] > 0 and r["bytes_recv"] > 0
    for name in reports[0]:  # every byte sent was received by someone
        assert sum(r[name]["bytes_sent"] for r in reports) == sum(r[name]["bytes_recv"] for r in reports)


@pytest.mark.daemon
def test_every_scheme_over_processes_on_loopback(processes):
    check(run_cluster(processes, 4))


@pytest.mark.netns
def test_every_scheme_over_processes_in_the_emulated_cluster(processes, emulated_cluster):
    """Four hosts in their own network namespaces, 1 Gbit/s links shaped in both directions."""
    check(run_cluster(processes, 4, emulated_cluster(4, rate_mbit=1000)))
