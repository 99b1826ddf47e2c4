"""Steps per second of a small job while strangers flood the daemon's metrics port (issue 32).

Two daemons on loopback, one trainer each, a 1-row tensor stepped for `--seconds`; the same job
again while 4 threads of another process scrape node 0's metrics endpoint as fast as they can, and again while 300 idle
connections sit on it. Before the endpoint was bounded and cached, the scrape flood cut a job from
264 to 20 steps/s. CPU seconds per daemon are read from /proc beside the wall time.

    python benchmarks/listener_flood.py [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from proc_cpu import cpu_seconds

from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.protocol.session import TrainerSession


def steps_per_second(c: LocalCluster, seconds: float, job: str) -> float:
    """Both trainers step in lockstep; node 0 names the last step once the time is up (two steps ahead:
    node 1 is at most one step ahead of it, so it reads the end before it could pass it)."""
    end: list[int | None] = [None]
    deadline = time.monotonic() + seconds

    def trainer(node: int) -> None:
        with TrainerSession(c.socket_dir(node), job, c.token(job), 0, 1, timeout_s=60) as link:
            h = link.register("w", (1000, 8))
            grad = SparseGrad(torch.tensor([node]), torch.ones(1, 8), 1000)
            step = 0
            while end[0] is None or step < end[0]:
                link.allreduce(h, grad, step)
                step += 1
                if node == 0 and end[0] is None and time.monotonic() > deadline:
                    end[0] = step + 2

    threads = [threading.Thread(target=trainer, args=(n,)) for n in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert end[0] is not None
    return end[0] / (time.monotonic() - started)


@contextmanager
def nothing() -> Iterator[list[int]]:
    yield [0]


SCRAPER = """
import sys, threading, urllib.request
url, threads = sys.argv[1], int(sys.argv[2])
def scrape():
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            print(1, flush=True)
        except OSError:
            pass
for _ in range(threads):
    threading.Thread(target=scrape, daemon=True).start()
threading.Event().wait()
"""


@contextmanager
def scraping(url: str, threads: int) -> Iterator[list[int]]:
    """`threads` threads scraping as fast as they can, in a process of their own (not this one's GIL)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRAPER, url, str(threads)], stdout=subprocess.PIPE, text=True)
    done = [0]
    counter = threading.Thread(target=lambda: done.__setitem__(0, sum(1 for _ in proc.stdout or [])), daemon=True)
    counter.start()
    try:
        yield done
    finally:
        proc.kill()
        proc.wait()
        counter.join(10)


@contextmanager
def idle(port: int, count: int) -> Iterator[list[int]]:
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break
    try:
        yield [len(held)]
    finally:
        for s in held:
            s.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(2, tmp, extra=["--log-format", "json"]) as c:
        url = f"http://127.0.0.1:{c.metrics_ports[0]}/metrics"
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("no flood", lambda: nothing()),
            ("4 threads scraping", lambda: scraping(url, 4)),
            ("300 idle connections", lambda: idle(c.metrics_ports[0], 300)),
        ]
        for i, (label, flood) in enumerate(cases):
            before = [cpu_seconds(c.procs[n].pid) for n in range(2)]
            with flood() as extra:
                rate = steps_per_second(c, args.seconds, f"bench{i}")
            cpu = [cpu_seconds(c.procs[n].pid) - before[n] for n in range(2)]
            rows.append({"case": label, "steps_per_s": round(rate, 1), "flood": extra[0],
                         "daemon_cpu_s": [round(x, 2) for x in cpu]})
    if args.json:
        print(json.dumps({"seconds": args.seconds, "rows": rows}))
        return
    print(f"2 daemons on loopback, 1 trainer each, a 1-row tensor, {args.seconds:g} s per case")
    print(f"{'case':<22} {'steps/s':>8} {'scrapes or conns':>17} {'daemon CPU s (0, 1)':>20}")
    for r in rows:
        print(f"{r['case']:<22} {r['steps_per_s']:8.1f} {r['flood']:>17} {r['daemon_cpu_s']!s:>20}")


if __name__ == "__main__":
    main()
