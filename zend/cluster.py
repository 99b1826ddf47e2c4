"""`zend cluster`: N zend daemons on this machine, and trainers that push real gradients through them.

`LocalCluster` starts one `zend serve` process per node, on loopback or inside the emulated
network namespaces (zend/emulated.py), each with its own socket folder; tests and benchmarks
use it too. The command then runs `trainers` processes per node (zend/workload.py), each
sending the embedding gradient of its own slice of the real text trace every step, checking
the sum against a reference it computes itself, and prints one table row per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from zend.daemon.commands import health_status
from zend.daemon.jobs import job_token


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """`with LocalCluster(4, workdir) as c:` N daemons; `c.socket_dir(i)`, `c.token(job)`, `c.kill(i)`."""

    def __init__(self, nodes: int, workdir: str | Path, *, transport: str = "tcp", emulated: Any = None,
                 metrics: bool = True, rendezvous: bool = False, extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, ready_timeout_s: float = 60.0):
        if nodes < 1:
            raise ValueError(f"nodes {nodes} must be at least 1")
        self.nodes, self.workdir = nodes, Path(workdir)
        self.transport, self.emulated, self.extra = transport, emulated, list(extra)
        self.ready_timeout_s = ready_timeout_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.workdir / "cluster.secret"
        self.secret = secrets.token_hex(24).encode()
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.secret)
        hosts = [emulated.address(i) if emulated else "127.0.0.1" for i in range(nodes)]
        ports = [7000 if emulated else free_port() for _ in range(nodes)]
        self.peers = [f"{transport}://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
        self.metrics_ports = [free_port() if metrics and not emulated else 0 for _ in range(nodes)]
        # rendezvous: node 0 hosts torch's TCPStore; nobody is told the others' addresses
        self.store = f"{hosts[0]}:{free_port() if not emulated else 29500}" if rendezvous else ""
        self.env = {**os.environ, **(env or {}), "ZEN_CLUSTER_SECRET_FILE": str(self.secret_file)}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def socket_dir(self, node: int) -> str:
        return str(self.workdir / f"node{node}")

    def log_path(self, node: int) -> Path:
        return self.workdir / f"node{node}.log"

    def token(self, job: str) -> str:
        return job_token(self.secret, job)

    def argv(self, node: int) -> list[str]:
        membership = ["--rendezvous", self.store, "--listen", self.peers[node]] if self.store else [
            "--peers", ",".join(self.peers)]
        return [sys.executable, "-m", "zend", "serve", "--rank", str(node), "--world-size", str(self.nodes),
                *membership, "--transport", self.transport,
                "--socket-dir", self.socket_dir(node), "--metrics-port", str(self.metrics_ports[node]),
                "--metrics-host", "127.0.0.1", *self.extra]

    def start_node(self, node: int) -> None:
        log = open(self.log_path(node), "ab")  # noqa: SIM115 (the child owns it)
        argv = self.argv(node)
        if self.emulated is not None:
            argv = ["ip", "netns", "exec", self.emulated.namespace(node), *argv]
        self.procs[node] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def __enter__(self) -> LocalCluster:
        try:
            for i in range(self.nodes):
                self.start_node(i)
            for i in range(self.nodes):
                self.wait_ready(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, node: int, timeout_s: float | None = None) -> None:
        """Until the node's health check says SERVING; the error carries the end of its log."""
        deadline = time.monotonic() + (timeout_s or self.ready_timeout_s)
        address = f"unix:{os.path.join(self.socket_dir(node), 'zend.sock')}"
        while time.monotonic() < deadline:
            proc = self.procs.get(node)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"zend node {node} exited with {proc.returncode}:\n{self.log_tail(node)}")
            with contextlib.suppress(grpc.RpcError):
                if health_status(address, 1.0) == "SERVING":
                    return
            time.sleep(0.1)
        raise RuntimeError(f"zend node {node} not ready within the timeout:\n{self.log_tail(node)}")

    def log_tail(self, node: int, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(node).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[node]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(30)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


# ---------------------------------------------------------------------- the command
def add_cluster_command(sub: Any) -> None:
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


def cmd_cluster(args: argparse.Namespace) -> int:
    from zend.emulated import EmulatedCluster

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
            procs = []
            for node in range(args.nodes):
                for r in range(args.trainers):
                    argv = [sys.executable, "-m", "zend.workload", "--socket-dir", cluster.socket_dir(node),
                            "--job", job, "--local-rank", str(r), "--local-world-size", str(args.trainers),
                            "--node", str(node), "--nodes", str(args.nodes), "--steps", str(args.steps),
                            "--dim", str(args.dim)]
                    env = {**os.environ, "ZEN_JOB_TOKEN": cluster.token(job)}
                    procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env))
            for proc in procs:
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


# ---------------------------------------------------------------------- a local training job
def rank_env(node: int, local: int, nodes: int, trainers: int, master_port: int, cluster: LocalCluster | None,
             job: str) -> dict[str, str]:
    """torchrun's variables for one rank, and the sidecar's ZEN_* ones when there is a cluster."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(node * trainers + local),
           "WORLD_SIZE": str(nodes * trainers), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(trainers),
           "OMP_NUM_THREADS": "1"}
    if cluster is not None:
        env.update(ZEN_SOCKET_DIR=cluster.socket_dir(node), ZEN_JOB=job, ZEN_JOB_TOKEN=cluster.token(job))
    return env


def run_local_job(argv: Sequence[str], nodes: int, trainers: int, job: str, with_zen: bool) -> int:
    """`argv` as NODES x TRAINERS ranks on this machine (with a zend cluster if `with_zen`).

    Returns the worst exit code; when a rank fails, the others (which would wait for it in
    their process group) are stopped at once.
    """
    with tempfile.TemporaryDirectory(prefix=f"zen-{job}-") as tmp, contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(nodes, Path(tmp), extra=["--log-format", "text"])) \
            if with_zen else None
        port = free_port()
        procs = [subprocess.Popen(list(argv), env={**os.environ, **rank_env(n, r, nodes, trainers, port, cluster, job)})
                 for n in range(nodes) for r in range(trainers)]
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    return max(abs(p.returncode) for p in procs)
