"""Communication time per scheme on the emulated cluster, beside torch.distributed gloo.

n hosts in network namespaces (zend.cluster.netns), each link shaped to --rate-mbit in both
directions. Every host runs one rank (benchmarks/emulated_worker.py): every scheme over the
chosen transport on the real GPT-2 trace (embedding rows of --dim floats), then, on the same
namespaces, gloo's all_reduce of the same gradient as a sparse COO tensor (torch's own sparse
allreduce) and as a dense tensor. Median of --steps steps after one warm-up. Also prints each
scheme's bottleneck bytes divided by the link rate (the time the wire alone needs).
Needs root and iproute2.

    python benchmarks/emulated_cluster.py --nodes 2,4,8 --rate-mbit 50,1000,10000 [--transport tcp|ucx]
        [--dim 64 --seqs 8 | --dim 256 --seqs 32 | --workload topk] [--security aead,none] [--json]

`--security` runs the table with the data plane's frames sealed (aead, the daemon's default)
and/or in clear (none), each on fresh namespaces: the difference is the cost of sealing.

`vs fastest` is each row's time over the fastest of our schemes in the same run (auto's target:
within 1.05). auto runs its profile and trials before the timed steps; its choice is shown.
The `commit` row is not a scheme: it is the two one-byte all-to-all rounds every daemon step
ends with (NodeSteps.commit: nobody delivers before every node holds the result); its
`vs fastest` is its share of the fastest scheme's time.
`cpu ms/rank` is the CPU time (every thread, user and kernel) a rank's process spent on one
step, the mean over ranks: n ranks share this machine's cores, so where n x cpu / cores comes
near the step time, the step is bound by this machine's CPU, not by the emulated wire.
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


def run(n: int, rate_mbit: float, transport: str, dim: int, steps: int, seqs: int, workload: str = "rows",
        schemes: str | None = None, security: str = "aead", engine: str = "python") -> dict[str, dict[str, float]]:
    env = dict(os.environ, ZEN_CLUSTER_SECRET=secrets.token_hex(16), UCX_TLS="tcp", PYTHONPATH=str(ROOT))
    with EmulatedCluster(n, rate_mbit=rate_mbit) as cluster:
        procs = []
        for r in range(n):
            argv = [sys.executable, str(ROOT / "benchmarks" / "emulated_worker.py"), "--uri",
                    f"{transport}://{cluster.address(r)}:0", "--rank", str(r), "--world-size", str(n),
                    "--master", f"{cluster.address(0)}:29612", "--dim", str(dim), "--steps", str(steps),
                    "--seqs", str(seqs), "--workload", workload, "--security", security, "--engine", engine,
                    *(["--schemes", schemes] if schemes else [])]
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
    out: dict[str, dict[str, float]] = {
        k: {"seconds": max(r[k]["seconds"] for r in reports),
            "bottleneck": max(max(r[k]["sent"], r[k]["recv"]) for r in reports),
            "cpu": sum(r[k].get("cpu", 0.0) for r in reports) / n} for k in reports[0]}
    if "auto" in reports[0]:
        out["auto"]["choice"] = reports[0]["auto"]["choice"]  # the same on every rank
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="4,8")
    p.add_argument("--rate-mbit", default="50", help="one rate or a comma-separated list, e.g. 1000,10000")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8, help="sequences of 512 tokens per rank and step")
    p.add_argument("--workload", default="rows", choices=["rows", "topk"],
                   help="rows: GPT-2 embedding rows; topk: 1%% of a 25M-element dense gradient")
    p.add_argument("--schemes", default=None, help="comma-separated subset (default: all, and auto)")
    p.add_argument("--security", default="aead", help="aead (sealed frames), none (clear), or both: aead,none")
    p.add_argument("--engine", default="python",
                   help="tcp:// data-plane engine: python, native (zend._engine), or both: python,native")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    args = p.parse_args()
    rows = []
    for rate_mbit, n, security, engine in ((float(r), int(n), sec, e) for r in args.rate_mbit.split(",")
                                           for n in args.nodes.split(",") for sec in args.security.split(",")
                                           for e in args.engine.split(",")):
        rate = rate_mbit * 1e6 / 8
        res = run(n, rate_mbit, args.transport, args.dim, args.steps, args.seqs, args.workload, args.schemes,
                  security, engine)
        gs, gd = res["gloo_sparse"]["seconds"], res["gloo_dense"]["seconds"]
        ours = {k: v["seconds"] for k, v in res.items() if not k.startswith("gloo") and k not in ("auto", "commit")}
        fastest = min(ours, key=lambda k: ours[k]) if ours else ""
        for name, r in res.items():
            wire = r["bottleneck"] / rate if r["bottleneck"] else 0.0
            rows.append({"rate_mbit": rate_mbit, "n": n, "security": security, "engine": engine, "scheme": name,
                         "ms": r["seconds"] * 1e3,
                         "wire_ms": wire * 1e3, "time_over_wire": r["seconds"] / wire if wire else None,
                         "vs_gloo_sparse": gs / r["seconds"], "vs_gloo_dense": gd / r["seconds"],
                         "vs_fastest": r["seconds"] / ours[fastest] if fastest else None,
                         "cpu_ms_per_rank": r["cpu"] * 1e3, "choice": r.get("choice")})
    if args.json:
        print(json.dumps({"transport": args.transport, "workload": args.workload, "dim": args.dim,
                          "seqs": args.seqs, "steps": args.steps, "rows": rows}))
        return
    what = (f"GPT-2 trace ({args.seqs}x512 tokens per rank), rows of {args.dim} fp32" if args.workload == "rows"
            else "top-k 1% of a 25M-element fp32 gradient")
    print(f"emulated cluster, transport {args.transport}, {what}, median of {args.steps} steps")
    print(f"{'Mbit/s':>7} {'n':>3} {'frames':<6} {'engine':<6} {'scheme':<12} {'time ms':>9} {'wire ms':>9} "
          f"{'time/wire':>9} "
          f"{'vs fastest':>10} {'cpu ms/rank':>11} {'vs gloo sparse':>15} {'vs gloo dense':>14}")
    for r in rows:
        ratio = f"{r['time_over_wire']:9.2f}" if r["time_over_wire"] else f"{'-':>9}"
        fast = f"{r['vs_fastest']:10.2f}" if r["vs_fastest"] else f"{'-':>10}"
        label = r["scheme"] + (f" ({r['choice']})" if r["choice"] else "")
        cpu = f"{r['cpu_ms_per_rank']:11.1f}" if r["cpu_ms_per_rank"] else f"{'-':>11}"
        print(f"{r['rate_mbit']:>7g} {r['n']:>3} {r['security']:<6} {r['engine']:<6} {label:<12} {r['ms']:9.1f} "
              f"{r['wire_ms']:9.1f} "
              f"{ratio} {fast} {cpu} {r['vs_gloo_sparse']:14.2f}x {r['vs_gloo_dense']:13.2f}x")


if __name__ == "__main__":
    from zend.cluster.launcher import signals_end_the_job

    with signals_end_the_job():  # SIGTERM unwinds like Ctrl-C: its namespaces and processes go too
        main()
