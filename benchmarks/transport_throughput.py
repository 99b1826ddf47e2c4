"""One-way throughput and small-message latency of the data plane, on loopback.

Two ranks in this process (each transport runs its own receiver threads, so bytes do cross
real sockets / UCX endpoints), for tcp:// and ucx:// (when ucxx is installed). Compare with
the raw figures of the platform notes (blocking recv_into about 2.8-4.6 GB/s, ucxx over shared
memory about 5 GB/s, gloo send/recv 2.3-3.0 GB/s on these machines).

    python benchmarks/transport_throughput.py [--transports tcp,ucx]
"""

from __future__ import annotations

import argparse
import importlib.util
import secrets
import threading
import time

import torch

from zend.runtime import tune_allocator
from zend.transport import create

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]


def pair(scheme: str):  # type: ignore[no-untyped-def]
    secret = secrets.token_bytes(16)
    a, b = (create(f"{scheme}://127.0.0.1:0", r, 2, cluster_id="bench", secret=secret, timeout_s=60)
            for r in range(2))
    peers = {0: a.address, 1: b.address}
    t = threading.Thread(target=a.connect, args=(peers,))
    t.start()
    b.connect(peers)
    t.join()
    return a, b


def throughput(a, b, size: int, total: int = 256 << 20) -> float:  # type: ignore[no-untyped-def]
    count = max(4, total // size)
    payload = torch.ones(size, dtype=torch.uint8)
    b.send(0, "warm", payload)
    a.recv(1, "warm")
    start = time.perf_counter()
    sender = threading.Thread(target=lambda: [b.send(0, f"m{i}", payload) for i in range(count)])
    sender.start()
    for i in range(count):
        a.recv(1, f"m{i}")
    sender.join()
    return count * size / (time.perf_counter() - start) / 1e9


def latency(a, b, rounds: int = 300) -> float:  # type: ignore[no-untyped-def]
    tiny = torch.zeros(8, dtype=torch.uint8)

    def echo() -> None:
        for i in range(rounds):
            b.send(0, f"pong{i}", b.recv(0, f"ping{i}"))

    t = threading.Thread(target=echo)
    t.start()
    start = time.perf_counter()
    for i in range(rounds):
        a.send(1, f"ping{i}", tiny)
        a.recv(1, f"pong{i}")
    t.join()
    return (time.perf_counter() - start) / rounds / 2 * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transports", default="tcp,ucx")
    args = p.parse_args()
    tune_allocator()
    print(f"{'transport':<10} " + " ".join(f"{s >> 10:>9} KiB" for s in SIZES) + f" {'8 B latency':>12}")
    for scheme in args.transports.split(","):
        if scheme == "ucx" and importlib.util.find_spec("ucxx") is None:
            print(f"{scheme:<10} (ucxx not installed: pip install '.[ucx]')")
            continue
        a, b = pair(scheme)
        try:
            rates = [throughput(a, b, s) for s in SIZES]
            lat = latency(a, b)
        finally:
            b.close()
            a.close()
        print(f"{scheme:<10} " + " ".join(f"{r:9.2f} GB/s" for r in rates) + f" {lat:9.0f} us")
    print("one way, two ranks in one process over loopback; GB/s = 1e9 bytes per second")


if __name__ == "__main__":
    main()
