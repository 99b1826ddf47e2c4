"""Every scheme over real processes and real sockets: n = 4 ranks on loopback."""

from __future__ import annotations

import json

from tests.transport.conftest import Workers
from zend.emulated import EmulatedCluster


def run_cluster(workers: Workers, n: int, cluster: EmulatedCluster | None = None) -> list[dict]:
    def host(r: int) -> str:
        return cluster.address(r) if cluster else "127.0.0.1"

    procs = [workers.start(r, n, "schemes", host=host(r), cluster=cluster) for r in range(n)]
    peers = {r: (host(r), port) for r, (_, port) in enumerate(procs)}
    for proc, _ in procs:
        workers.send_peers(proc, peers)
    reports = []
    for proc, _ in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and not line.startswith("{"):  # skip libraries' chatter
            line = proc.stdout.readline()
        assert line, f"worker exited with {proc.wait(30)}"
        reports.append(json.loads(line))
    return reports


def check(reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        assert set(report) == {"zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto"}
        for name, r in report.items():
            assert r["max_error"] < 1e-3, (rank, name, r)
            assert r["bytes_sent"] > 0 and r["bytes_recv"] > 0
    for name in reports[0]:  # every byte sent was received by someone
        assert sum(r[name]["bytes_sent"] for r in reports) == sum(r[name]["bytes_recv"] for r in reports)


def test_every_scheme_over_processes_on_loopback(workers):
    check(run_cluster(workers, 4))


def test_every_scheme_over_processes_in_the_emulated_cluster(workers, emulated_cluster):
    """Four hosts in their own network namespaces, 1 Gbit/s links shaped in both directions."""
    check(run_cluster(workers, 4, emulated_cluster(4, rate_mbit=1000)))
