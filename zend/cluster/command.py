"""`zend cluster`: N zend daemons on this machine, and trainers that push real gradients through them.

The command starts a LocalCluster (on loopback, or in network namespaces with --emulated),
then runs `trainers` processes per node (workload.py), each sending the embedding gradient of
its own slice of the real text trace every step and checking the sum against a reference it
computes itself, and prints one table row per step as soon as every trainer has reported it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zend.runtime.arguments import LazyChoices

if TYPE_CHECKING:  # grpc and torch (through the schemes) only when the command runs: `zend --help` builds this
    from zend.cluster.local import LocalCluster

STALL_TIMEOUT_S = 600.0  # no trainer printed a step for this long: give up on them


def _scheme_names() -> list[str]:
    from zend.core.schemes import SCHEMES

    return list(SCHEMES)


def add_commands(sub: Any) -> None:
    """Add `cluster` to the `zend` command's subparsers."""
    p = sub.add_parser("cluster", help="start N daemons on this machine and push real gradients through them",
                       description="Start N zend daemons on this machine (loopback, or network namespaces with "
                                   "--emulated), run TRAINERS processes per node that synchronise the embedding "
                                   "gradient of the real text trace, check every sum, and print a row per step "
                                   "as it completes.")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2, help="trainer processes per node (default 2)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--scheme", default="auto", choices=LazyChoices(_scheme_names), metavar="SCHEME",
                   help="the daemons' scheme: %(choices)s (default %(default)s)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
    p.add_argument("--emulated", type=float, default=None, metavar="MBIT",
                   help="run each daemon in its own network namespace behind a link of MBIT Mbit/s (needs root)")
    p.add_argument("--workdir", default=None,
                   help="folder of the daemons' sockets and logs, kept afterwards (default: a temporary folder, "
                        "removed after a run where every sum was right, kept and named when anything failed)")
    p.set_defaults(run=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from zend.cluster.local import LocalCluster
    from zend.cluster.netns import EmulatedCluster

    if args.nodes < 1 or args.trainers < 1 or args.steps < 1:
        print(f"zend cluster: --nodes {args.nodes}, --trainers {args.trainers} and --steps {args.steps} must be >= 1",
              file=sys.stderr)
        return 2
    temporary = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zend-cluster-"))
    trainers = args.nodes * args.trainers
    rows: list[dict[str, Any]] = []
    failed = 0
    clean = False
    job = "demo"
    started = time.perf_counter()
    try:
        try:
            with contextlib.ExitStack() as stack:
                emulated = stack.enter_context(EmulatedCluster(args.nodes, rate_mbit=args.emulated)) \
                    if args.emulated else None
                where = f"network namespaces at {args.emulated} Mbit/s" if emulated else "loopback"
                kept = " (removed after a clean run, kept if anything fails)" if temporary else ""
                print(f"{args.nodes} zend daemons on {where} ({args.transport}), {args.trainers} trainers each; "
                      f"logs in {workdir}{kept}", flush=True)
                cluster = stack.enter_context(LocalCluster(args.nodes, workdir, transport=args.transport,
                                                           emulated=emulated, extra=["--scheme", args.scheme,
                                                                                     "--log-format", "text"]))
                procs: list[subprocess.Popen[str]] = []
                stack.callback(_kill_running, procs)  # before the daemons stop, whatever ends the run
                procs += [start_trainer(cluster, args, job, node, r) for node in range(args.nodes)
                          for r in range(args.trainers)]
                print(HEADER, flush=True)
                for step_rows in steps_as_they_complete(procs, STALL_TIMEOUT_S):
                    rows.extend(step_rows)
                    print(format_row(step_rows, trainers), flush=True)
                _kill_running(procs)  # none left, unless one stalled for STALL_TIMEOUT_S
                failed = sum(1 for proc in procs if proc.wait() != 0)
        except (RuntimeError, OSError, ValueError) as exc:  # e.g. a daemon that would not start: exc ends its log
            print(f"zend cluster: {exc}", file=sys.stderr)
            return 1
        bad = sum(1 for r in rows if not r["ok"])
        print(f"{len(rows)} trainer-steps, {bad} wrong, {failed} trainers failed; "
              f"{time.perf_counter() - started:.1f} s")
        clean = not bad and not failed
        return 0 if clean else 1
    finally:  # Ctrl-C included: only a clean run's temporary folder goes
        if temporary and clean:
            shutil.rmtree(workdir, ignore_errors=True)
        elif temporary:
            print(f"logs kept in {workdir}", flush=True)


def _kill_running(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def start_trainer(cluster: LocalCluster, args: argparse.Namespace, job: str, node: int, local_rank: int
                  ) -> subprocess.Popen[str]:
    """One workload trainer (workload.py) of `node`, printing a JSON line per step."""
    argv = [sys.executable, "-m", "zend.cluster.workload", "--socket-dir", cluster.socket_dir(node), "--job", job,
            "--local-rank", str(local_rank), "--local-world-size", str(args.trainers), "--node", str(node),
            "--nodes", str(args.nodes), "--steps", str(args.steps), "--dim", str(args.dim)]
    env = {**os.environ, "ZEN_JOB_TOKEN": cluster.token(job)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)


def steps_as_they_complete(procs: list[subprocess.Popen[str]], stall_timeout_s: float
                           ) -> Iterator[list[dict[str, Any]]]:
    """Each step's rows (the JSON lines the trainers print), in step order, as soon as every trainer has
    reported the step or exited; then whatever is left once all have exited or none printed for
    stall_timeout_s."""
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def pump(i: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((i, line))
        lines.put((i, None))  # its stdout closed: it has exited, or is about to

    for i, proc in enumerate(procs):
        threading.Thread(target=pump, args=(i, proc), daemon=True, name=f"trainer-{i}").start()
    everyone = set(range(len(procs)))
    by_step: dict[int, list[dict[str, Any]]] = {}
    reported: dict[int, set[int]] = {}  # step -> the trainers that printed it
    done: set[int] = set()
    while len(done) < len(procs):
        try:
            i, line = lines.get(timeout=stall_timeout_s)
        except queue.Empty:
            break
        if line is None:
            done.add(i)
        elif line.startswith("{"):
            row = json.loads(line)
            by_step.setdefault(row["step"], []).append(row)
            reported.setdefault(row["step"], set()).add(i)
        while by_step:
            first = min(by_step)
            if not (reported[first] | done) >= everyone:
                break
            reported.pop(first)
            yield by_step.pop(first)
    for step in sorted(by_step):  # a stalled trainer's steps: the correct column shows who is missing
        yield by_step[step]


HEADER = (f"{'step':>4} {'scheme':<10} {'rows in':>8} {'rows out':>8} {'sent MB':>8} {'dense MB':>8} "
          f"{'saved':>6} {'sync ms':>8} {'correct':>8}")


def format_row(here: list[dict[str, Any]], trainers: int) -> str:
    """One step: what its node-0-most trainer saw, and how many of all `trainers` got the right sum."""
    first = min(here, key=lambda r: (r["node"], r["local_rank"]))
    ok = sum(1 for r in here if r["ok"])
    saved = 1 - first["bytes_sent"] / first["dense_bytes"] if first["dense_bytes"] else 0.0
    return (f"{first['step']:>4} {first['scheme']:<10} {first['nnz_in']:>8} {first['nnz_out']:>8} "
            f"{first['bytes_sent'] / 1e6:>8.3f} {first['dense_bytes'] / 1e6:>8.3f} {saved:>6.0%} "
            f"{first['seconds'] * 1e3:>8.1f} {ok:>3}/{trainers:<4}")

