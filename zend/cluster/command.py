"""`zend cluster`: N zend daemons on this machine, and trainers that push real gradients through them.

The command starts a LocalCluster (on loopback, or in network namespaces with --emulated),
then runs `trainers` processes per node (workload.py), each sending the embedding gradient of
its own slice of the real text trace every step and checking the sum against a reference it
computes itself, and prints one table row per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from zend.cluster.local import LocalCluster


def add_commands(sub: Any) -> None:
    """Add `cluster` to the `zend` command's subparsers."""
    p = sub.add_parser("cluster", help="start N daemons on this machine and push real gradients through them",
                       description="Start N zend daemons on this machine (loopback, or network namespaces with "
                                   "--emulated), run TRAINERS processes per node that synchronise the embedding "
                                   "gradient of the real text trace, check every sum, and print a row per step.")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2, help="trainer processes per node (default 2)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--scheme", default="auto")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--emulated", type=float, default=None, metavar="MBIT",
                   help="run each daemon in its own network namespace behind a link of MBIT Mbit/s (needs root)")
    p.add_argument("--workdir", default=None, help="sockets and logs (default: a temporary folder, removed after)")
    p.set_defaults(run=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from zend.cluster.netns import EmulatedCluster

    if args.nodes < 1 or args.trainers < 1 or args.steps < 1:
        print(f"zend cluster: --nodes {args.nodes}, --trainers {args.trainers} and --steps {args.steps} must be >= 1",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zend-cluster-"))
    rows: list[dict[str, Any]] = []
    failed = 0
    job = "demo"
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            emulated = stack.enter_context(EmulatedCluster(args.nodes, rate_mbit=args.emulated)) \
                if args.emulated else None
            cluster = stack.enter_context(LocalCluster(args.nodes, workdir, transport=args.transport,
                                                       emulated=emulated, extra=["--scheme", args.scheme,
                                                                                 "--log-format", "text"]))
            where = f"network namespaces at {args.emulated} Mbit/s" if emulated else "loopback"
            print(f"{args.nodes} zend daemons on {where} ({args.transport}), {args.trainers} trainers each; "
                  f"logs in {workdir}")
            for proc in [start_trainer(cluster, args, job, node, r) for node in range(args.nodes)
                         for r in range(args.trainers)]:
                out, _ = proc.communicate(timeout=600)
                failed += int(proc.returncode != 0)
                rows.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
            print(format_rows(rows, args.nodes * args.trainers))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    bad = sum(1 for r in rows if not r["ok"])
    print(f"{len(rows)} trainer-steps, {bad} wrong, {failed} trainers failed; {time.perf_counter() - started:.1f} s")
    return 1 if bad or failed else 0


def start_trainer(cluster: LocalCluster, args: argparse.Namespace, job: str, node: int, local_rank: int
                  ) -> subprocess.Popen[str]:
    """One workload trainer (workload.py) of `node`, printing a JSON line per step."""
    argv = [sys.executable, "-m", "zend.cluster.workload", "--socket-dir", cluster.socket_dir(node), "--job", job,
            "--local-rank", str(local_rank), "--local-world-size", str(args.trainers), "--node", str(node),
            "--nodes", str(args.nodes), "--steps", str(args.steps), "--dim", str(args.dim)]
    env = {**os.environ, "ZEN_JOB_TOKEN": cluster.token(job)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)


def format_rows(rows: list[dict[str, Any]], trainers: int) -> str:
    """One line per step: what node 0's first trainer saw, and whether every trainer's sum was right."""
    lines = [f"{'step':>4} {'scheme':<10} {'rows in':>8} {'rows out':>8} {'sent MB':>8} {'dense MB':>8} "
             f"{'saved':>6} {'sync ms':>8} {'correct':>8}"]
    for step in sorted({r["step"] for r in rows}):
        here = [r for r in rows if r["step"] == step]
        first = min(here, key=lambda r: (r["node"], r["local_rank"]))
        ok = sum(1 for r in here if r["ok"])
        saved = 1 - first["bytes_sent"] / first["dense_bytes"] if first["dense_bytes"] else 0.0
        lines.append(f"{step:>4} {first['scheme']:<10} {first['nnz_in']:>8} {first['nnz_out']:>8} "
                     f"{first['bytes_sent'] / 1e6:>8.3f} {first['dense_bytes'] / 1e6:>8.3f} {saved:>6.0%} "
                     f"{first['seconds'] * 1e3:>8.1f} {ok:>3}/{trainers:<4}")
    return "\n".join(lines)
