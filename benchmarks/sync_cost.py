"""What one sync costs a rank on unshaped loopback: CPU per rank beside wall time, and zen against the raw
transfer of its own bytes (issue 26's "1-row sync" and "zen / raw transfer" rows).

n processes on 127.0.0.1, one transport each (tcp://, the native engine unless --engine python, sealed
frames unless --security none), no daemon: each rank calls `scheme.sync` itself, as emulated_worker.py
does in network namespaces. Two workloads:
  1row   a tensor of one row of --dim floats present on every rank (the fixed cost of a sync);
  trace  the GPT-2 embedding trace, --seqs x 512 tokens per rank, rows of --dim floats.
For each scheme: the median wall time of a sync (the slowest rank's) and the median CPU per rank (every
thread, user and kernel, mean over ranks). `raw` is the same transport moving each rank's zen bytes with
no scheme: one message per peer, in one round, of the bytes zen sent it (the wire's own cost of zen's
traffic on this link). `commit` is the daemon's two one-byte rounds (NodeSteps.commit).
Wall time mixes every rank's CPU on this machine's cores; CPU per rank is what a node with its own
cores pays.

    .venv/bin/python benchmarks/sync_cost.py [--nodes 4] [--workloads 1row,trace] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("zen", "agsparse", "sparse_ps")


def _grads(workload: str, rank: int, steps: int, dim: int, seqs: int) -> list[Any]:
    from zend.core.sparse import SparseGrad
    from zend.simulator.traces import TokenTrace

    if workload == "1row":
        return [SparseGrad(torch.tensor([7]), torch.full((1, dim), float(rank + s)), 50257) for s in range(steps)]
    trace = TokenTrace.default(seqs=seqs, seq_len=512)
    return [trace.embedding_grad(rank, s % 4, dim) for s in range(steps)]


def _timed(transport: Any, label: str, call: Any, steps: int) -> dict[str, float]:
    """Median wall and CPU (this process, every thread) of call(s) for s in 1..steps, ranks lined up first."""
    from zend.core.comm import barrier

    wall, cpu = [], []
    for s in range(steps + 1):  # the first warms up
        barrier(transport, f"b/{label}/{s}")
        t0, c0 = time.perf_counter(), time.process_time()
        call(s)
        if s:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def _workload_rows(transport: Any, workload: str, grads: list[Any], steps: int) -> dict[str, dict[str, float]]:
    """This rank's figures for every scheme, the raw transfer of zen's bytes, and the commit."""
    from zend.core import Channel, make_scheme
    from zend.daemon.node_steps import NodeSteps

    others = [j for j in range(transport.world_size) if j != transport.rank]
    rows: dict[str, dict[str, float]] = {}
    sent_to: dict[int, int] = {}  # bytes zen sent each peer (its largest sync)
    for name in SCHEMES:
        scheme = make_scheme(name, seed=1)

        def sync(s: int, scheme: Any = scheme, name: str = name) -> None:
            r = scheme.sync(Channel(transport, f"{workload}/{name}/{s}", timeout_s=120), grads[s])
            if name == "zen":
                for j in others:
                    sent_to[j] = max(sent_to.get(j, 0), r.traffic.bytes_sent // len(others))
        rows[name] = _timed(transport, f"{workload}/{name}", sync, steps)
    payloads = {j: torch.zeros(max(1, sent_to.get(j, 1)), dtype=torch.uint8) for j in others}

    def raw(s: int) -> None:
        transport.exchange([(j, f"{workload}/raw/{s}", payloads[j]) for j in others],
                           [(j, f"{workload}/raw/{s}") for j in others])
    rows["raw"] = _timed(transport, f"{workload}/raw", raw, steps)
    rows["raw"]["bytes"] = float(sum(p.numel() for p in payloads.values()))
    node = NodeSteps(transport, 120.0)
    rows["commit"] = _timed(transport, f"{workload}/commit", lambda s: node.commit(
        Channel(transport, f"{workload}/commit/{s}", timeout_s=120), time.monotonic()), steps)
    return rows


def worker(args: argparse.Namespace) -> None:
    from zend.core.comm import barrier
    from zend.daemon.secret import load_secret
    from zend.runtime.tuning import tune_allocator
    from zend.transport import create

    torch.set_num_threads(1)
    tune_allocator()
    transport = create("tcp://127.0.0.1:0", args.rank, args.nodes, engine=args.engine, cluster_id="bench",
                       secret=load_secret(), timeout_s=120, security=args.security)
    print(f"PORT {transport.address[1]}", flush=True)
    transport.connect({int(k): (v[0], int(v[1])) for k, v in json.loads(sys.stdin.readline()).items()})
    out = {w: _workload_rows(transport, w, _grads(w, args.rank, args.steps + 1, args.dim, args.seqs), args.steps)
           for w in args.workloads.split(",")}
    barrier(transport, "end")
    print(json.dumps(out), flush=True)
    transport.close()


def _line_starting(proc: subprocess.Popen[str], prefix: str) -> str:
    """The worker's next line that starts with `prefix` (its other output, e.g. log lines, skipped)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line and not line.startswith(prefix):
        line = proc.stdout.readline()
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--workloads", default="1row,trace")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seqs", type=int, default=32, help="sequences of 512 tokens per rank (trace)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--engine", default="native", choices=["native", "python"])
    p.add_argument("--security", default="aead", choices=["aead", "none"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        worker(args)
        return 0
    from zend.daemon.secret import new_secret

    env = dict(os.environ, ZEN_CLUSTER_SECRET=new_secret(), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *sys.argv[1:]], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(args.nodes)]
    try:
        ports = [int(_line_starting(proc, "PORT ").split()[1]) for proc in procs]
        peers = json.dumps({str(r): ["127.0.0.1", ports[r]] for r in range(args.nodes)})
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(peers + "\n")
            proc.stdin.flush()
        reports = [json.loads(_line_starting(proc, "{")) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    table: dict[str, dict[str, dict[str, float]]] = {}
    for workload in reports[0]:
        table[workload] = {name: {"wall_ms": max(r[workload][name]["wall"] for r in reports) * 1e3,
                                  "cpu_ms_per_rank": statistics.mean(r[workload][name]["cpu"] for r in reports) * 1e3}
                           for name in reports[0][workload]}
        zen, raw = table[workload]["zen"], table[workload]["raw"]
        table[workload]["zen"]["over_raw"] = zen["wall_ms"] / raw["wall_ms"]
        table[workload]["raw"]["bytes_per_rank"] = max(r[workload]["raw"]["bytes"] for r in reports)
    if args.json:
        print(json.dumps({"nodes": args.nodes, "engine": args.engine, "security": args.security, "dim": args.dim,
                          "seqs": args.seqs, "workloads": table}))
        return 0
    print(f"n = {args.nodes} on loopback, engine {args.engine}, frames {args.security}, rows of {args.dim} fp32; "
          f"medians of {args.steps} syncs: wall (slowest rank) and CPU per rank (mean over ranks)")
    for workload, rows in table.items():
        print(f"\n{workload}" + (f" ({args.seqs} x 512 tokens per rank)" if workload == "trace" else "")
              + f": raw = zen's own bytes, {rows['raw']['bytes_per_rank'] / 1e6:.3f} MB sent per rank, one round")
        print(f"{'':10s} {'wall ms':>9s} {'cpu ms/rank':>12s} {'x raw':>7s}")
        for name, row in rows.items():
            print(f"{name:10s} {row['wall_ms']:9.3f} {row['cpu_ms_per_rank']:12.3f} "
                  f"{row['wall_ms'] / rows['raw']['wall_ms']:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
