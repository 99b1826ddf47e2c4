"""A step of many small tensors against one big one, through the daemons (DDP sends a bucket at a time).

`LocalCluster(n)` on loopback, one trainer process per node using `zen.Client`. Per round, after
a 1-row allreduce lines the trainers up: one tensor of --big-kib KiB, then --count tensors of
--small-kib KiB each submitted at once with `allreduce_async` (a pool of --workers threads, as a
DDP comm hook does), then the same --count tensors fused into one step (`allreduce_many`).
Rows of 256 fp32 (1 KiB), 1/4 of each table's rows present. The table shows medians over
--rounds of the slowest trainer's time; the target is count x small < 2 x big.

    .venv/bin/python benchmarks/many_tensors.py [--nodes 2] [--count 32] [--small-kib 64] [--big-kib 2048]
        [--rounds 7] [--json]
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

import torch

ROOT = Path(__file__).resolve().parents[1]
ROW = 256


def grad(rows: int, node: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * (node + 1) + seed)
    present = rows // 4
    idx = torch.randperm(4 * present, generator=g)[:present].sort().values.unsqueeze(0)
    return torch.sparse_coo_tensor(idx, torch.randn(present, ROW, generator=g), (4 * present, ROW),
                                   check_invariants=True).coalesce()


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "client"))
    import zen

    torch.set_num_threads(1)
    node = args.node
    big = grad(args.big_kib * 4, node, 0)  # 4 x the present rows: KiB of rows present = KiB asked
    small = [grad(args.small_kib * 4, node, 1 + i) for i in range(args.count)]
    fence = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 1), (1, 1))
    times: dict[str, list[float]] = {"big": [], "many": [], "fused": []}
    names = [f"small{i}" for i in range(args.count)]
    with zen.Client(max_workers=args.workers) as client:
        for r in range(args.rounds + 1):
            client.allreduce(fence, name="fence")
            t0 = time.perf_counter()
            client.allreduce(big, name="big")
            t_big = time.perf_counter() - t0
            client.allreduce(fence, name="fence")
            t0 = time.perf_counter()
            futures = [client.allreduce_async(s, name=f"small{i}") for i, s in enumerate(small)]
            for f in futures:
                f.wait()
            t_many = time.perf_counter() - t0
            client.allreduce(fence, name="fence")
            t0 = time.perf_counter()
            client.allreduce_many(small, names=names)
            t_fused = time.perf_counter() - t0
            if r:  # round 0 warms up (registration, first-step agreement)
                times["big"].append(t_big)
                times["many"].append(t_many)
                times["fused"].append(t_fused)
    print(json.dumps(times), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--small-kib", type=int, default=64)
    p.add_argument("--big-kib", type=int, default=2048)
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
        outs = [json.loads(proc.communicate(timeout=600)[0].strip().splitlines()[-1]) for proc in procs]
    slowest = {k: [max(o[k][i] for o in outs) for i in range(args.rounds)] for k in ("big", "many", "fused")}
    big, many, fused = (statistics.median(slowest[k]) for k in ("big", "many", "fused"))
    result = {"nodes": args.nodes, "scheme": args.scheme, "count": args.count, "small_kib": args.small_kib,
              "big_kib": args.big_kib, "big_ms": big * 1e3, "many_ms": many * 1e3, "fused_ms": fused * 1e3,
              "many_over_big": many / big, "fused_over_big": fused / big}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.nodes} nodes on loopback, scheme {args.scheme}, median of {args.rounds} rounds (slowest trainer)")
    print(f"one tensor of {args.big_kib} KiB:            {big * 1e3:8.2f} ms")
    print(f"{args.count} tensors of {args.small_kib} KiB at once:   {many * 1e3:8.2f} ms   "
          f"= {many / big:.2f}x the one (a step each, allreduce_async)")
    print(f"{args.count} tensors of {args.small_kib} KiB fused:     {fused * 1e3:8.2f} ms   "
          f"= {fused / big:.2f}x the one (allreduce_many; target < 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
