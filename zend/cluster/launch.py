"""`zend launch`: from a training script to a running zen job in one command.

    zend launch --nodes 2 --trainers 2 -- train.py --lr 0.1          # this machine: 2 daemons, 4 trainers
    zend launch --nnodes 4 --node-rank 1 --master-addr 10.0.0.1 --trainers 8 -- train.py   # one node of 4

It starts the node's daemon(s) (or reuses one that already serves), waits until they serve, gives
the trainers their environment (socket folder, job, token) and runs torchrun; it stops what it
started when the job ends, on Ctrl-C or on SIGTERM, and keeps the daemons' logs when the job fails.
On one machine it makes a cluster secret for the run (user-only, in the run folder under
$XDG_RUNTIME_DIR or the temp folder): no root, no variable to set. A multi-node job needs the
same secret on every node (ZEN_CLUSTER_SECRET_FILE), like any cluster of zend daemons; the daemon it
starts reads its other settings from ZEND_* variables, as `zend serve` does.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DATA_PORT = 7000  # the data plane's port in a multi-node job (zend serve's convention)
RENDEZVOUS_PORT = 7001  # zend's one-shot rendezvous store, on the master's address


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "launch", help="run a training script under torchrun beside zend daemons: starts them, waits, stops them",
        description="Start this node's zend daemon (or, with --nodes, a local cluster of them), wait until it "
                    "serves, then run the script under torchrun with the trainers' environment set.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=1, help="this machine only: how many nodes (daemons) to run")
    p.add_argument("--trainers", "--nproc-per-node", dest="trainers", type=int, default=1,
                   help="trainer processes per node")
    p.add_argument("--job", default="", help="the job's name (default: the script's name)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts every trainer of the job after one fails, up to this many times "
                        "(zen.checkpoint's Checkpointer.load_latest resumes the job)")
    node = p.add_argument_group("one node of a multi-node job (torchrun's node flags)")
    node.add_argument("--nnodes", type=int, default=0, help="nodes of the job (0: this machine only, see --nodes)")
    node.add_argument("--node-rank", type=int, default=-1, help="this node's rank, 0 .. nnodes-1; left out, "
                      "ranks come from the rendezvous (zend's --rank auto, torchrun's c10d backend)")
    node.add_argument("--master-addr", default="", help="node 0's address (zend's rendezvous and torchrun's)")
    node.add_argument("--master-port", type=int, default=29500, help="torchrun's port on node 0")
    node.add_argument("--rendezvous-port", type=int, default=RENDEZVOUS_PORT,
                      help="zend's rendezvous store on --master-addr (node 0's daemon hosts it)")
    node.add_argument("--listen", default="", help="this node's data-plane URI (default: tcp://<the address "
                                                   f"this host reaches --master-addr from>:{DATA_PORT})")
    p.add_argument("--run-dir", default="", help="where the run's sockets, logs and secret go (default: a new "
                                                 "folder under $XDG_RUNTIME_DIR, else the temp folder)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py ARGS")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = list(args.script[1:] if args.script[:1] == ["--"] else args.script)
    if not script:
        raise SystemExit("zend launch: no script: zend launch [options] -- train.py ARGS")
    if args.trainers < 1 or args.nodes < 1:
        raise SystemExit(f"zend launch: --nodes {args.nodes} and --trainers {args.trainers} must be at least 1")
    if args.max_restarts < 0:
        raise SystemExit(f"zend launch: --max-restarts {args.max_restarts} must be 0 or more")
    if args.max_restarts and args.nnodes > 1 and args.node_rank >= 0:
        raise SystemExit(f"zend launch: --max-restarts {args.max_restarts} with --node-rank {args.node_rank}: "
                         "torchrun's static rendezvous restarts each node alone, and the new trainers never form "
                         "their group; leave --node-rank out (its c10d rendezvous restarts every node together)")
    job = args.job or Path(script[0]).stem or "default"
    parent = args.run_dir or run_parent()
    try:
        if args.nnodes:
            return _one_node_of_many(args, script, job, parent)
        from zend.cluster.launcher import run_local_job

        return run_local_job(script, args.nodes, args.trainers, job, with_zen=True, run_parent=parent,
                             max_restarts=args.max_restarts)
    except KeyboardInterrupt:
        print("zend launch: interrupted; what it started is stopped", file=sys.stderr)
        return 130


SOCKET_PATH_ROOM = 64  # a unix socket's path must fit in 108 bytes: the run folder's own part takes ~40


def run_parent() -> str | None:
    """Where a run's folder goes: $XDG_RUNTIME_DIR (the user's own tmpfs) if usable, else the temp folder."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    usable = xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK) and len(xdg) <= SOCKET_PATH_ROOM
    return xdg if usable else None


def local_address_towards(host: str) -> str:
    """The address this machine uses to reach `host` (no packet is sent: a UDP socket's route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def _one_node_of_many(args: argparse.Namespace, script: Sequence[str], job: str, parent: str | None) -> int:
    """This node's daemon (started here, or one already serving at ZEN_SOCKET_DIR), then torchrun."""
    from zend.cluster.launcher import signals_end_the_job
    from zend.daemon.secret import SecretError, load_secret
    from zend.protocol import paths

    if not -1 <= args.node_rank < args.nnodes or not args.master_addr:
        raise SystemExit(f"zend launch: --nnodes {args.nnodes} needs --master-addr (given {args.master_addr!r}) "
                         f"and, if given, --node-rank in [0, {args.nnodes}) (given {args.node_rank})")
    rank = str(args.node_rank) if args.node_rank >= 0 else "auto"
    try:
        secret = load_secret()
    except (SecretError, OSError) as exc:
        raise SystemExit(f"zend launch: a multi-node job needs the cluster secret on every node ({exc}): "
                         "`zend secret > FILE` once, then ZEN_CLUSTER_SECRET_FILE=FILE on each node") from None
    running = os.environ.get(paths.SOCKET_DIR_ENV, "")
    reuse = bool(running) and _serves(running)
    run_dir = Path(tempfile.mkdtemp(prefix=f"zen-{job[:16]}-", dir=parent))
    socket_dir = running if reuse else str(run_dir / "zend")
    failed = True
    try:
        with signals_end_the_job():  # SIGTERM / SIGHUP unwind like Ctrl-C: the daemon and torchrun are stopped
            return_code = _serve_and_train(args, script, job, secret, rank, reuse, run_dir, socket_dir)
        failed = return_code != 0
        return return_code
    except KeyboardInterrupt:  # Ctrl-C: a stop, not a failure: nothing kept
        failed = False
        raise
    except SystemExit as exc:  # SIGTERM / SIGHUP (an exit code) is a stop too; a failed start (a message) is not
        failed = not isinstance(exc.code, int)
        raise
    finally:
        _end_run(run_dir, job, failed)


def _serve_and_train(args: argparse.Namespace, script: Sequence[str], job: str, secret: bytes, rank: str,
                     reuse: bool, run_dir: Path, socket_dir: str) -> int:
    """The node's daemon unless one is reused, then torchrun; both stopped on the way out."""
    from zend.cluster.launcher import RESTART_ENV, stop_group, torchrun_command
    from zend.cluster.local import wait_serving
    from zend.daemon.jobs import job_token
    from zend.protocol import paths

    daemon: subprocess.Popen[bytes] | None = None
    try:
        if not reuse:
            listen = args.listen or f"tcp://{local_address_towards(args.master_addr)}:{DATA_PORT}"
            log = open(run_dir / "zend.log", "ab")  # noqa: SIM115 (the child owns it)
            daemon = subprocess.Popen(
                [sys.executable, "-m", "zend", "serve", "--rank", rank, "--world-size",
                 str(args.nnodes), "--rendezvous", f"{args.master_addr}:{args.rendezvous_port}", "--listen", listen,
                 "--socket-dir", socket_dir, "--log-format", "text"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            try:
                wait_serving(paths.grpc_address(socket_dir), daemon, run_dir / "zend.log", timeout_s=600)
            except RuntimeError as exc:
                raise SystemExit(f"zend launch: {exc}") from None
        env = {**os.environ, paths.SOCKET_DIR_ENV: socket_dir, "ZEN_JOB": job,
               "ZEN_JOB_TOKEN": os.environ.get("ZEN_JOB_TOKEN") or job_token(secret, job), "OMP_NUM_THREADS":
               os.environ.get("OMP_NUM_THREADS", "1"), **(RESTART_ENV if args.max_restarts else {})}
        agent = subprocess.Popen(
            torchrun_command(script, args.node_rank, args.nnodes, args.trainers, args.master_port,
                             master_addr=args.master_addr, rendezvous_id=job, max_restarts=args.max_restarts),
            env=env, start_new_session=True)
        try:
            return abs(agent.wait())
        finally:
            stop_group(agent)
    finally:
        if daemon is not None:
            stop_group(daemon)


def _serves(socket_dir: str) -> bool:
    import grpc

    from zend.protocol import paths
    from zend.protocol.health import health_status

    try:
        return health_status(paths.grpc_address(socket_dir), 2.0) == "SERVING"
    except grpc.RpcError:
        return False


def _end_run(run_dir: Path, job: str, failed: bool) -> None:
    """The run folder goes; when the job failed its logs are kept first, and where they are is said."""
    import shutil

    from zend.cluster.launcher import keep_logs

    if failed:
        keep_logs(run_dir, job)
    shutil.rmtree(run_dir, ignore_errors=True)
