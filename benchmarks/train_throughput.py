"""Steps per second of example (a) (examples/gpt_sparse.py) on the emulated cluster: zen against DDP + gloo.

n ranks, one per network namespace behind a rate-limited link (zend/cluster/netns.py), a zend daemon
in each namespace for the zen runs. In the same run and on the same namespaces:
  zen            DDP with zen.comm_hook: the sparse embedding through the daemons, dense buckets by gloo
  zen+topk       the same, dense buckets top-k (1%) with error feedback through the daemons
  gloo sparse    plain DDP: torch's own sparse allreduce for the embedding, gloo allreduce for the rest
  gloo dense     plain DDP with a dense embedding
Needs root and iproute2.

    .venv/bin/python benchmarks/train_throughput.py [--nodes 4] [--rate-mbit 100] [--steps 12]
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

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"zen": ["--backend", "zen"], "zen+topk": ["--backend", "zen", "--dense", "topk"],
        "gloo sparse": ["--backend", "gloo"], "gloo dense": ["--backend", "gloo-dense"]}


def run_one(name: str, args: argparse.Namespace, emulated: object, workdir: Path, port: int) -> list[dict]:
    from zend.cluster.local import LocalCluster

    n = args.nodes
    model = ["--steps", str(args.steps), "--json", "--dim", str(args.dim), "--layers", "1", "--context", "64",
             "--batch", "4", *RUNS[name]]
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(n, workdir / name.replace(" ", "-").replace("+", "-"),
                                                   emulated=emulated, metrics=False,
                                                   extra=["--log-format", "text"])) if "zen" in name else None
        procs = []
        for rank in range(n):
            env = {**os.environ, "MASTER_ADDR": emulated.address(0), "MASTER_PORT": str(port),  # type: ignore[attr-defined]
                   "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth0"}
            if cluster is not None:
                env.update(ZEN_SOCKET_DIR=cluster.socket_dir(rank), ZEN_JOB="bench",
                           ZEN_JOB_TOKEN=cluster.token("bench"))
            argv = ["ip", "netns", "exec", emulated.namespace(rank),  # type: ignore[attr-defined]
                    sys.executable, str(ROOT / "examples/gpt_sparse.py"), *model]
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=1200)
                if p.returncode != 0:
                    raise RuntimeError(f"{name}: a rank failed:\n{err[-2000:]}")
                outs.append(out)
        finally:  # a failed rank leaves the others waiting for it: never leave them behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


def main() -> int:
    from zend.cluster.netns import EmulatedCluster, available

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the mean (warm-up)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {list(RUNS)}")
    args = p.parse_args()
    reason = available()
    if reason:
        print(f"train_throughput: {reason}", file=sys.stderr)
        return 2
    names = [r for r in args.runs.split(",") if r]
    results = {}
    with tempfile.TemporaryDirectory(prefix="zen-train-") as tmp, \
            EmulatedCluster(args.nodes, rate_mbit=args.rate_mbit) as emulated:
        for i, name in enumerate(names):
            rows = run_one(name, args, emulated, Path(tmp), 29400 + i)
            timed = rows[args.skip:]
            results[name] = (mean(r["seconds"] for r in timed), rows[0]["loss"], rows[-1]["loss"])
            print(f"  {name}: {results[name][0] * 1e3:.0f} ms/step", file=sys.stderr, flush=True)
    best_gloo = min(v[0] for k, v in results.items() if k.startswith("gloo")) if any(
        k.startswith("gloo") for k in results) else float("nan")
    print(f"example (a), n = {args.nodes} ranks in network namespaces at {args.rate_mbit:g} Mbit/s, dim {args.dim}, "
          f"mean over steps {args.skip}..{args.steps - 1}")
    print(f"{'run':<12} {'ms/step':>8} {'steps/s':>8} {'vs best gloo':>12} {'loss first':>10} {'loss last':>10}")
    for name, (sec, first, last) in results.items():
        print(f"{name:<12} {sec * 1e3:>8.0f} {1 / sec:>8.2f} {best_gloo / sec:>11.2f}x {first:>10.3f} {last:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
