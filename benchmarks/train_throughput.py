"""Steps per second of the examples on the emulated cluster: zen against DDP + gloo.

n ranks, one per network namespace behind a rate-limited link (zend/cluster/netns.py), a zend daemon
in each namespace for the zen runs. In the same run and on the same namespaces:
  zen            plain DDP on the "zen" torch.distributed backend: the sparse tables through the
                 daemons (a backward pass's tables fused into one step per dtype), dense buckets by
                 the backend's inner gloo group
  zen hook       DDP on gloo with zen.comm_hook: the same split
  ... unfused    the same with ZEN_FUSE=0: a zen step per sparse bucket
  zen+topk       the hook, dense buckets top-k (1%) with error feedback through the daemons (gpt only)
  gloo sparse    plain DDP: torch's own sparse allreduce for the tables, gloo allreduce for the rest
  gloo dense     plain DDP with dense tables
  local          every rank alone (a world of one, no communication) at the same time: the compute
                 time of a step on this machine's shared cores; `comm share` of a run is
                 1 - local / its step time
Examples (--example): gpt, example (a), examples/gpt_sparse.py; gpt-sampled, the same with a
sampled-softmax output embedding (sparse tables >= 70% of the parameters); recsys, example (b),
examples/recsys.py (MovieLens, `make data` or scripts/fetch_movielens.py first). Needs root and iproute2.
Beside wall time, CPU per step and per process (every thread, user + kernel): rank 0's trainer (its
process_time over each timed step: its batch and report left out) and the mean daemon (/proc, sampled
every 10 ms and interpolated, from the end of the last warm-up step to the end of the last step, the
gaps between steps included). With n ranks and n daemons on two cores, wall time mixes everyone's
CPU; the CPU columns are what a node would spend.

    .venv/bin/python benchmarks/train_throughput.py [--example gpt] [--nodes 4] [--rate-mbit 100] [--steps 12]
        [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

from proc_cpu import CpuSampler

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"zen": ["--backend", "zen"], "zen ckpt": ["--backend", "zen", "--checkpoint-every", "1"],
        "zen hook": ["--backend", "zen-hook"],
        "zen+topk": ["--backend", "zen-hook", "--dense", "topk"],
        "zen unfused": ["--backend", "zen"], "zen hook unfused": ["--backend", "zen-hook"],
        "gloo sparse": ["--backend", "gloo"], "gloo dense": ["--backend", "gloo-dense"], "local": ["--backend", "gloo"]}
RUN_ENV = {"zen unfused": {"ZEN_FUSE": "0"}, "zen hook unfused": {"ZEN_FUSE": "0"}}  # a step per sparse bucket
EXAMPLES = {  # script, model arguments, the runs it offers
    "gpt": ("examples/gpt_sparse.py", ["--layers", "1", "--context", "64", "--batch", "4"], list(RUNS)),
    "gpt-sampled": ("examples/gpt_sparse.py", ["--layers", "1", "--context", "64", "--batch", "4", "--sampled",
                                              "1024"], list(RUNS)),
    "recsys": ("examples/recsys.py", ["--batch", "512"], [r for r in RUNS if r != "zen+topk"]),
}


def run_one(name: str, args: argparse.Namespace, emulated: object, workdir: Path,
            port: int) -> tuple[list[dict], float | None]:
    """Rank 0's rows, one per step, and the daemons' mean CPU seconds per timed step (None without daemons)."""
    from zend.cluster.launcher import wait_for_ranks
    from zend.cluster.local import LocalCluster

    n = args.nodes
    script, model_args, _ = EXAMPLES[args.example]
    model = ["--steps", str(args.steps), "--json", "--dim", str(args.dim), *model_args, *RUNS[name]]
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(n, workdir / name.replace(" ", "-").replace("+", "-"),
                                                   emulated=emulated, metrics=False,
                                                   extra=["--log-format", "text"])) if "zen" in name else None
        sampler = stack.enter_context(CpuSampler([p.pid for p in cluster.procs.values()])) if cluster else None
        procs = []
        for rank in range(n):
            alone = name == "local"  # a world of one per rank: the same compute, no communication
            master = emulated.address(rank if alone else 0)  # type: ignore[attr-defined]
            env = {**os.environ, "MASTER_ADDR": master, "MASTER_PORT": str(port), "RANK": "0" if alone else str(rank),
                   "WORLD_SIZE": "1" if alone else str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0",
                   **RUN_ENV.get(name, {})}
            if cluster is not None:
                env.update(ZEN_SOCKET_DIR=cluster.socket_dir(rank), ZEN_JOB="bench",
                           ZEN_JOB_TOKEN=cluster.token("bench"))
            argv = ["ip", "netns", "exec", emulated.namespace(rank),  # type: ignore[attr-defined]
                    sys.executable, str(ROOT / script), *model]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = wait_for_ranks(procs, 1200, f"{name}: a rank")
        rows = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
        daemon_cpu = None
        if sampler is not None:  # from the end of the last warm-up step to the end of the last step
            try:
                per_daemon = sampler.between(rows[args.skip - 1]["end"], rows[-1]["end"])
                daemon_cpu = mean(per_daemon) / (len(rows) - args.skip)
            except ValueError as exc:  # the run's wall time still counts
                print(f"  {name}: no daemon CPU: {exc}", file=sys.stderr, flush=True)
    return rows, daemon_cpu


def main() -> int:
    from zend.cluster.launcher import signals_end_the_job
    from zend.cluster.netns import EmulatedCluster, available

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the mean (warm-up)")
    p.add_argument("--example", choices=list(EXAMPLES), default="gpt")
    p.add_argument("--dim", type=int, default=None, help="embedding width (default 64 for gpt, 16 for recsys)")
    p.add_argument("--runs", default=None, help=f"comma-separated, from {list(RUNS)} (default: all the example offers)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not 1 <= args.skip < args.steps:
        p.error(f"--skip {args.skip}: at least 1 (the timed window starts at a step's end) and under --steps")
    if args.dim is None:
        args.dim = 16 if args.example == "recsys" else 64
    reason = available()
    if reason:
        print(f"train_throughput: {reason}", file=sys.stderr)
        return 2
    names = [r for r in (args.runs or ",".join(EXAMPLES[args.example][2])).split(",") if r]
    results = {}
    # SIGTERM unwinds like Ctrl-C: the ranks, the daemons and the namespaces go too
    with signals_end_the_job(), tempfile.TemporaryDirectory(prefix="zen-train-") as tmp, \
            EmulatedCluster(args.nodes, rate_mbit=args.rate_mbit) as emulated:
        for i, name in enumerate(names):
            rows, daemon_cpu = run_one(name, args, emulated, Path(tmp), 29400 + i)
            timed = rows[args.skip:]
            results[name] = (mean(r["seconds"] for r in timed), mean(r["cpu_seconds"] for r in timed), daemon_cpu,
                             rows[0]["loss"], rows[-1]["loss"])
            print(f"  {name}: {results[name][0] * 1e3:.0f} ms/step", file=sys.stderr, flush=True)
    gloo = [v[0] for k, v in results.items() if k.startswith("gloo")]
    best_gloo = min(gloo) if gloo else None  # no gloo run: no ratio (not NaN, which is not JSON)
    local = results["local"][0] if "local" in results else None
    table = [{"run": name, "ms_per_step": sec * 1e3, "steps_per_s": 1 / sec,
              "vs_best_gloo": None if best_gloo is None else best_gloo / sec,
              "comm_share": (max(0.0, 1 - local / sec) if local is not None and name != "local" else None),
              "trainer_cpu_ms": cpu * 1e3, "daemon_cpu_ms": None if daemon is None else daemon * 1e3,
              "loss_first": first, "loss_last": last}
             for name, (sec, cpu, daemon, first, last) in results.items()]
    if args.json:
        print(json.dumps({"example": args.example, "nodes": args.nodes, "rate_mbit": args.rate_mbit,
                          "dim": args.dim, "steps": args.steps, "skip": args.skip, "runs": table}))
        return 0
    print(f"example {args.example}, n = {args.nodes} ranks in network namespaces at {args.rate_mbit:g} Mbit/s, "
          f"dim {args.dim}, mean over steps {args.skip}..{args.steps - 1}")
    print("cpu ms: per step and per process (every thread, user + kernel): rank 0's trainer, and the mean daemon")
    print(f"{'run':<16} {'ms/step':>8} {'steps/s':>8} {'vs best gloo':>12} {'comm share':>10} {'trainer cpu':>11} "
          f"{'daemon cpu':>10} {'loss first':>10} {'loss last':>10}")
    for r in table:
        share = f"{r['comm_share']:10.0%}" if r["comm_share"] is not None else f"{'-':>10}"
        daemon = f"{r['daemon_cpu_ms']:10.1f}" if r["daemon_cpu_ms"] is not None else f"{'-':>10}"
        ratio = f"{r['vs_best_gloo']:>11.2f}x" if r["vs_best_gloo"] is not None else f"{'-':>12}"
        print(f"{r['run']:<16} {r['ms_per_step']:>8.0f} {r['steps_per_s']:>8.2f} {ratio} {share} "
              f"{r['trainer_cpu_ms']:>11.1f} {daemon} {r['loss_first']:>10.3f} {r['loss_last']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
