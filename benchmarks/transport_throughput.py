"""One-way throughput and small-message latency of the data plane, on loopback.

Two ranks in two processes, one transport each (the shape the daemons run in): this process
sends, a child process (`--peer`) receives and acknowledges each batch, then echoes pings.
For tcp:// and ucx:// (when ucxx is installed). For comparison, raw loopback figures measured
on our 2-core machines, 1-64 MiB one way: blocking socket recv_into 2.8-4.6 GB/s, ucxx over
shared memory about 5 GB/s, torch gloo send/recv 2.3-3.0 GB/s.

    python benchmarks/transport_throughput.py [--transports tcp,ucx] [--security aead,none] [--json]

`--security`: frames sealed (aead, AES-256-GCM, the default) and/or in clear (none); the two rows
of a transport, measured in one run, give the cost of sealing on this machine's loopback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time

import torch

from zend.runtime.tuning import tune_allocator
from zend.transport import create

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
ROUNDS = 300  # ping-pongs for the latency


def count(size: int, total: int = 256 << 20) -> int:
    return max(4, total // size)


def peer(scheme: str, security: str) -> None:
    """Rank 1: receive every batch and acknowledge it, then echo the pings."""
    t = create(f"{scheme}://127.0.0.1:0", 1, 2, cluster_id="bench", secret=os.environ["ZEN_CLUSTER_SECRET"].encode(),
               timeout_s=120, security=security)
    print(f"PORT {t.port}", flush=True)
    t.connect({0: ("127.0.0.1", int(sys.stdin.readline())), 1: t.address})
    done = torch.zeros(1, dtype=torch.uint8)
    for size in SIZES:
        t.recv(0, f"warm{size}")
        for i in range(count(size)):
            t.recv(0, f"m{size}/{i}")
        t.send(0, f"ack{size}", done)
    for i in range(ROUNDS):
        t.send(0, f"pong{i}", t.recv(0, f"ping{i}"))
    t.recv(0, "bye")
    t.close()


def measure(scheme: str, security: str) -> tuple[list[float], float]:
    """(GB/s per size, one-way latency in us) against a peer process."""
    secret = secrets.token_hex(16)
    me = create(f"{scheme}://127.0.0.1:0", 0, 2, cluster_id="bench", secret=secret.encode(), timeout_s=120,
                security=security)
    child = subprocess.Popen([sys.executable, __file__, "--peer", scheme, "--security", security],
                             stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, ZEN_CLUSTER_SECRET=secret))
    try:
        assert child.stdin is not None and child.stdout is not None
        line = child.stdout.readline()
        while line and not line.startswith("PORT "):
            line = child.stdout.readline()
        child.stdin.write(f"{me.port}\n")
        child.stdin.flush()
        me.connect({0: me.address, 1: ("127.0.0.1", int(line.split()[1]))})
        rates = []
        for size in SIZES:
            payload = torch.ones(size, dtype=torch.uint8)
            me.send(1, f"warm{size}", payload)
            start = time.perf_counter()
            for i in range(count(size)):
                me.send(1, f"m{size}/{i}", payload)
            me.recv(1, f"ack{size}")
            rates.append(count(size) * size / (time.perf_counter() - start) / 1e9)
        tiny = torch.zeros(8, dtype=torch.uint8)
        start = time.perf_counter()
        for i in range(ROUNDS):
            me.send(1, f"ping{i}", tiny)
            me.recv(1, f"pong{i}")
        latency = (time.perf_counter() - start) / ROUNDS / 2 * 1e6
        me.send(1, "bye", tiny)
        child.wait(30)
        return rates, latency
    finally:
        if child.poll() is None:
            child.kill()
        me.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="tcp,ucx")
    p.add_argument("--security", default="aead,none", help="aead (sealed frames), none (clear), or both")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--peer", metavar="SCHEME", help=argparse.SUPPRESS)
    args = p.parse_args()
    tune_allocator()
    if args.peer:
        peer(args.peer, args.security)
        return
    rows = []
    for scheme in args.transports.split(","):
        if scheme == "ucx" and importlib.util.find_spec("ucxx") is None:
            print(f"{scheme:<10} (ucxx not installed: pip install '.[ucx]')", file=sys.stderr)
            continue
        for security in args.security.split(","):
            rates, lat = measure(scheme, security)
            rows.append({"transport": scheme, "security": security, "latency_us": lat,
                         "gb_per_s": {str(size): rate for size, rate in zip(SIZES, rates, strict=True)}})
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    print(f"{'transport':<10} {'frames':<6} " + " ".join(f"{s >> 10:>9} KiB" for s in SIZES) + f" {'8 B latency':>12}")
    for row in rows:
        print(f"{row['transport']:<10} {row['security']:<6} " +
              " ".join(f"{row['gb_per_s'][str(s)]:9.2f} GB/s" for s in SIZES) + f" {row['latency_us']:9.0f} us")
    print("one way, rank 0 in this process, rank 1 in a child process, loopback; GB/s = 1e9 bytes per second")


if __name__ == "__main__":
    main()
