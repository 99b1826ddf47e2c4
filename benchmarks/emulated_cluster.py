"""Communication time per scheme on the emulated cluster, beside torch.distributed gloo.

n hosts in network namespaces (zend.cluster.netns), each link shaped to --rate-mbit in both
directions. Every host runs one rank (benchmarks/emulated_worker.py): every scheme over the
chosen transport on the real GPT-2 trace (embedding rows of --dim floats), then, on the same
namespaces, gloo's all_reduce of the same gradient as a sparse COO tensor (torch's own sparse
allreduce) and as a dense tensor. Median of --steps steps after one warm-up. Also prints each
scheme's bottleneck bytes divided by the link rate (the time the wire alone needs).
Needs root and iproute2.

    python benchmarks/emulated_cluster.py --nodes 4,8 --rate-mbit 50 [--transport tcp] [--seqs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from zend.cluster.netns import EmulatedCluster

ROOT = Path(__file__).resolve().parents[1]


def run(n: int, rate_mbit: float, transport: str, dim: int, steps: int, seqs: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ, ZEN_CLUSTER_SECRET=secrets.token_hex(16), UCX_TLS="tcp", PYTHONPATH=str(ROOT))
    with EmulatedCluster(n, rate_mbit=rate_mbit) as cluster:
        procs = []
        for r in range(n):
            argv = [sys.executable, str(ROOT / "benchmarks" / "emulated_worker.py"), "--uri",
                    f"{transport}://{cluster.address(r)}:0", "--rank", str(r), "--world-size", str(n),
                    "--master", f"{cluster.address(0)}:29612", "--dim", str(dim), "--steps", str(steps),
                    "--seqs", str(seqs)]
            procs.append(cluster.popen(r, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        ports = []
        for proc in procs:
            line = proc.stdout.readline()
            while line and not line.startswith("PORT "):
                line = proc.stdout.readline()
            ports.append(int(line.split()[1]))
        peers = json.dumps({str(r): [cluster.address(r), ports[r]] for r in range(n)})
        for proc in procs:
            proc.stdin.write(peers + "\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            line = proc.stdout.readline()
            while line and not line.startswith("{"):
                line = proc.stdout.readline()
            reports.append(json.loads(line))
    # the slowest rank decides; bytes are per rank already maxima over steps
    return {k: {"seconds": max(r[k]["seconds"] for r in reports),
                "bottleneck": max(max(r[k]["sent"], r[k]["recv"]) for r in reports)} for k in reports[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="4,8")
    p.add_argument("--rate-mbit", type=float, default=50.0)
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences of 512 tokens per rank and step")
    args = p.parse_args()
    rate = args.rate_mbit * 1e6 / 8
    print(f"emulated cluster, {args.rate_mbit:g} Mbit/s links, transport {args.transport}, GPT-2 trace "
          f"({args.seqs}x512 tokens per rank), rows of {args.dim} fp32, median of {args.steps} steps")
    print(f"{'n':>3} {'scheme':<12} {'time ms':>9} {'wire ms':>9} {'time/wire':>9} {'vs gloo sparse':>15} "
          f"{'vs gloo dense':>14}")
    for n in (int(x) for x in args.nodes.split(",")):
        res = run(n, args.rate_mbit, args.transport, args.dim, args.steps, args.seqs)
        gs, gd = res["gloo_sparse"]["seconds"], res["gloo_dense"]["seconds"]
        for name, r in res.items():
            wire = r["bottleneck"] / rate if r["bottleneck"] else 0.0
            ratio = f"{r['seconds'] / wire:9.2f}" if wire else f"{'-':>9}"
            print(f"{n:>3} {name:<12} {r['seconds'] * 1e3:9.1f} {wire * 1e3:9.1f} {ratio} "
                  f"{gs / r['seconds']:14.2f}x {gd / r['seconds']:13.2f}x")


if __name__ == "__main__":
    main()
