"""Every scheme over real processes and real sockets: n = 4 ranks on loopback."""

from __future__ import annotations

import json

from tests.transport.conftest import Workers


def run_cluster(workers: Workers, n: int, host_of=lambda r: "127.0.0.1") -> list[dict]:  # type: ignore[no-untyped-def]
    procs = [workers.start(r, n, "schemes") for r in range(n)]
    peers = {r: (host_of(r), port) for r, (_, port) in enumerate(procs)}
    for proc, _ in procs:
        workers.send_peers(proc, peers)
    reports = []
    for proc, _ in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"worker exited with {proc.wait(30)}"
        reports.append(json.loads(line))
    return reports


def test_every_scheme_over_tcp_processes_equals_the_reference(workers):
    reports = run_cluster(workers, 4)
    for rank, report in enumerate(reports):
        assert set(report) == {"zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense", "auto"}
        for name, r in report.items():
            assert r["max_error"] < 1e-3, (rank, name, r)
            assert r["bytes_sent"] > 0 and r["bytes_recv"] > 0
    for name in reports[0]:  # every byte sent was received by someone
        assert sum(r[name]["bytes_sent"] for r in reports) == sum(r[name]["bytes_recv"] for r in reports)
