"""CPU per message-side of the data plane, and one link's throughput, for each engine (issue 26).

Two ranks in two processes on loopback, one transport each (the daemons' shape): this process sends a
stream of messages of one size, a child process (`--peer`) receives every one and acknowledges the batch,
either one `recv` per message (`stream`: the receiver wakes for each) or in rounds of ROUND messages taken
with one `exchange` (`round`: how a scheme takes a round's messages from its n - 1 peers).
Each side reports its own process CPU time (getrusage: every thread, the engine's I/O thread included)
over the batch; CPU per message-side is that divided by the messages. Wall time mixes both processes'
CPU on a 2-core machine; CPU per side is what a node with its own cores pays. Pairs: python-python,
native-native, and mixed (a native sender, a Python receiver, and the reverse) where the engine loads.

    python benchmarks/message_cost.py [--engines python,native,mixed] [--security aead,none] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import subprocess
import sys
import time

import torch

from zend.transport import create
from zend.transport.engine_choice import load_native

SMALL = [64, 4 << 10, 64 << 10]  # CPU per message-side
ROUND = 16  # messages taken per exchange in the round mode
BIG = 16 << 20  # throughput
PAIRS = {"python": ("python", "python"), "native": ("native", "native"), "mixed": ("native", "python"),
         "mixed-reverse": ("python", "native")}


def count(size: int) -> int:
    return 20000 if size <= 4096 else 4000 if size <= 65536 else 24


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peer(engine: str, security: str, mode: str) -> None:
    """Rank 1: receive every batch, then report its CPU and acknowledge."""
    t = create("tcp://127.0.0.1:0", 1, 2, engine=engine, cluster_id="bench",
               secret=os.environ["ZEN_CLUSTER_SECRET"].encode(), timeout_s=120, security=security)
    print(f"PORT {t.port}", flush=True)
    t.connect({0: ("127.0.0.1", int(sys.stdin.readline())), 1: t.address})
    for size in [*SMALL, BIG]:
        t.recv(0, f"warm{size}")
        c0 = cpu()
        n = count(size)
        if mode == "round":
            for start in range(0, n, ROUND):
                t.exchange([], [(0, f"m{size}/{i}") for i in range(start, min(n, start + ROUND))])
        else:
            for i in range(n):
                t.recv(0, f"m{size}/{i}")
        used = cpu() - c0
        t.send(0, f"ack{size}", torch.tensor([used], dtype=torch.float64).view(torch.uint8))
    t.recv(0, "bye")
    t.close()


def measure(sender: str, receiver: str, security: str, mode: str) -> dict[str, object]:
    secret = secrets.token_hex(16)
    me = create("tcp://127.0.0.1:0", 0, 2, engine=sender, cluster_id="bench", secret=secret.encode(),
                timeout_s=120, security=security)
    child = subprocess.Popen([sys.executable, __file__, "--peer", receiver, "--security", security, "--mode", mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "ZEN_CLUSTER_SECRET": secret})
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(child.stdout.readline().split()[1])
        child.stdin.write(f"{me.port}\n")
        child.stdin.flush()
        me.connect({0: me.address, 1: ("127.0.0.1", port)})
        row: dict[str, object] = {"sender": sender, "receiver": receiver, "security": security, "mode": mode}
        for size in [*SMALL, BIG]:
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            me.send(1, f"warm{size}", payload)
            n = count(size)
            c0, t0 = cpu(), time.perf_counter()
            for i in range(n):
                me.send(1, f"m{size}/{i}", payload)
            theirs = float(me.recv(1, f"ack{size}", 300).view(torch.float64)[0])
            wall, mine = time.perf_counter() - t0, cpu() - c0
            if size == BIG:
                row["big_gb_s"] = n * size / wall / 1e9
                row["big_send_cpu_ms"] = mine / n * 1e3
                row["big_recv_cpu_ms"] = theirs / n * 1e3
            else:
                row[f"send_us_{size}"] = mine / n * 1e6
                row[f"recv_us_{size}"] = theirs / n * 1e6
                row[f"wall_us_{size}"] = wall / n * 1e6
        me.send(1, "bye", torch.zeros(1, dtype=torch.uint8))
        child.wait(60)
        return row
    finally:
        if child.poll() is None:
            child.kill()
        me.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="python,native,mixed,mixed-reverse")
    p.add_argument("--security", default="aead,none")
    p.add_argument("--modes", default="stream,round")
    p.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer:
        peer(args.peer, args.security, args.mode)
        return
    native, why = load_native()
    rows = []
    for pair in args.engines.split(","):
        sender, receiver = PAIRS[pair]
        if native is None and "native" in (sender, receiver):
            print(f"skipping {pair}: {why}", file=sys.stderr)
            continue
        for security in args.security.split(","):
            for mode in args.modes.split(","):
                rows.append(measure(sender, receiver, security, mode))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    head = (f"{'sender':>7} {'recv':>7} {'seal':>5} {'mode':>6} | "
            + " | ".join(f"{s:>6} B send/recv/wall us" for s in SMALL) + f" | {BIG >> 20} MiB GB/s, send/recv CPU ms")
    print(head)
    for r in rows:
        cells = " | ".join(f"{r[f'send_us_{s}']:7.1f} {r[f'recv_us_{s}']:7.1f} {r[f'wall_us_{s}']:7.1f}"
                           for s in SMALL)
        print(f"{r['sender']:>7} {r['receiver']:>7} {r['security']:>5} {r['mode']:>6} | {cells} | "
              f"{r['big_gb_s']:5.2f}, {r['big_send_cpu_ms']:.1f}/{r['big_recv_cpu_ms']:.1f}")


if __name__ == "__main__":
    main()
