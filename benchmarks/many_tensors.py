"""A step of many small tensors against one big one, through the daemons (DDP sends a bucket at a time).

`LocalCluster(n)` on loopback, one trainer process per node using `zen.Client`. Per round, after
a 1-row allreduce lines the trainers up: one tensor of --big-kib KiB, then --count tensors of
--small-kib KiB each submitted at once with `allreduce_async` (a pool of --workers threads, as a
DDP comm hook does), then the same --count tensors fused (`allreduce_many`). Rows of 256 fp32
(1 KiB), 1/4 of each table's rows present. The table shows medians over --rounds of the slowest
trainer's time; the target is count x small < 2 x big.

--widths 256,64,...: small table i has rows of widths[i % len] fp32 values (the KiB present stay
the same). Fused, they go as one step of rows of the widths' common divisor (zen.fusion.batches);
a fourth arm fuses them as before, a step per width, to compare in the same run. Beside each arm,
CPU per round of the busiest daemon and trainer (from /proc, summed over the arm's windows).

    .venv/bin/python benchmarks/many_tensors.py [--nodes 2] [--count 32] [--small-kib 64] [--big-kib 2048]
        [--widths 256] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from proc_cpu import CpuSampler

ROOT = Path(__file__).resolve().parents[1]
ROW = 256


def grad(kib: int, node: int, seed: int, width: int = ROW) -> torch.Tensor:
    """A table with `kib` KiB of rows present (fp32 rows of `width`), 1/4 of its rows."""
    g = torch.Generator().manual_seed(1_000_003 * (node + 1) + seed)
    present = max(1, kib * 1024 // (4 * width))
    idx = torch.randperm(4 * present, generator=g)[:present].sort().values.unsqueeze(0)
    return torch.sparse_coo_tensor(idx, torch.randn(present, width, generator=g), (4 * present, width),
                                   check_invariants=True).coalesce()


ARMS = ("big", "many", "fused", "per_width")


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "client"))
    import zen

    torch.set_num_threads(1)
    node = args.node
    widths = [int(w) for w in args.widths.split(",")]
    big = grad(args.big_kib, node, 0)
    small = [grad(args.small_kib, node, 1 + i, widths[i % len(widths)]) for i in range(args.count)]
    fence = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 1), (1, 1))
    names = [f"small{i}" for i in range(args.count)]

    def many() -> None:
        for f in [client.allreduce_async(s, name=f"small{i}") for i, s in enumerate(small)]:
            f.wait()

    def per_width() -> None:  # fusion as it was: a step per row width
        shared, zen.fusion.MIN_SHARED_ROW_BYTES = zen.fusion.MIN_SHARED_ROW_BYTES, 2**62
        try:
            client.allreduce_many(small, names=names)
        finally:
            zen.fusion.MIN_SHARED_ROW_BYTES = shared

    arms = {"big": lambda: client.allreduce(big, name="big"), "many": many,
            "fused": lambda: client.allreduce_many(small, names=names), "per_width": per_width}
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    windows: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    with zen.Client(max_workers=args.workers) as client:
        for r in range(args.rounds + 1):
            for arm in ARMS:
                client.allreduce(fence, name="fence")
                w0, t0 = time.time(), time.perf_counter()
                arms[arm]()
                t1, w1 = time.perf_counter(), time.time()
                if r:  # round 0 warms up (registration, first-step agreement)
                    times[arm].append(t1 - t0)
                    windows[arm].append((w0, w1))
    print(json.dumps({"times": times, "windows": windows}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--small-kib", type=int, default=64)
    p.add_argument("--big-kib", type=int, default=2048)
    p.add_argument("--widths", default=str(ROW), help="row widths of the small tables, in turn (fp32 values)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=8, help="allreduce_async threads per trainer")
    p.add_argument("--scheme", default="auto")
    p.add_argument("--json", action="store_true")
    p.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.node is not None:
        worker(args)
        return 0
    from zend.cluster.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="zen-many-") as tmp, \
            LocalCluster(args.nodes, tmp, metrics=False, extra=["--scheme", args.scheme]) as cluster:
        procs = []
        for node in range(args.nodes):
            env = {**os.environ, "ZEN_SOCKET_DIR": cluster.socket_dir(node), "ZEN_JOB": "many",
                   "ZEN_JOB_TOKEN": cluster.token("many"), "PYTHONPATH": str(ROOT)}
            argv = [sys.executable, __file__, "--node", str(node), *sys.argv[1:]]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
        daemons = [p.pid for p in cluster.procs.values()]
        with CpuSampler(daemons + [p.pid for p in procs]) as sampler:
            outs = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1]) for proc in procs]
            cpu = {}  # arm -> CPU seconds per round of each process (node 0's windows)
            for arm in ARMS:
                spent = [sampler.between(t0, t1) for t0, t1 in outs[0]["windows"][arm]]
                cpu[arm] = [sum(s[i] for s in spent) / len(spent) for i in range(len(daemons) + len(procs))]
    n = len(daemons)
    result: dict[str, Any] = {"nodes": args.nodes, "scheme": args.scheme, "count": args.count,
                                 "small_kib": args.small_kib, "big_kib": args.big_kib, "widths": args.widths}
    for arm in ARMS:
        slowest = [max(o["times"][arm][i] for o in outs) for i in range(args.rounds)]
        result[f"{arm}_ms"] = statistics.median(slowest) * 1e3
        result[f"{arm}_daemon_cpu_ms"] = max(cpu[arm][:n]) * 1e3
        result[f"{arm}_trainer_cpu_ms"] = max(cpu[arm][n:]) * 1e3
    if args.json:
        print(json.dumps(result))
        return 0
    big = result["big_ms"]
    print(f"{args.nodes} nodes on loopback, scheme {args.scheme}, median of {args.rounds} rounds (slowest trainer); "
          f"CPU per round of the busiest daemon / trainer; small widths {args.widths}")
    print(f"{'arm':44s} {'wall ms':>8s} {'x big':>6s} {'daemon CPU':>11s} {'trainer CPU':>12s}")
    labels = {"big": f"one tensor of {args.big_kib} KiB",
              "many": f"{args.count} x {args.small_kib} KiB at once (a step each)",
              "fused": f"{args.count} x {args.small_kib} KiB fused (target < 2x)",
              "per_width": f"{args.count} x {args.small_kib} KiB fused, a step per width"}
    for arm in ARMS:
        ms = result[f"{arm}_ms"]
        print(f"{labels[arm]:44s} {ms:8.2f} {ms / big:6.2f} {result[f'{arm}_daemon_cpu_ms']:11.2f} "
              f"{result[f'{arm}_trainer_cpu_ms']:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
