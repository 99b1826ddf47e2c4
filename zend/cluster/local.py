"""`LocalCluster`: N zend daemons on this machine, one `zend serve` process per node.

On loopback, or inside the emulated network namespaces (netns.py), each node with its own
socket folder, log and cluster secret file; `zend cluster`, the example launcher, the tests
and the benchmarks all start their daemons through it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from zend.daemon.jobs import job_token, operator_token
from zend.daemon.secret import decode, new_secret
from zend.protocol import paths
from zend.protocol.health import health_status


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started a moment later. Drawn below the kernel's
    ephemeral range: a port the kernel hands out (bind to 0) can become an outgoing connection's
    source port before the server binds it ("Address already in use", seen in CI); one below the
    range is only ever taken by a bind that names it."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is crowded: the kernel's choice, as before
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_serving(address: str, proc: subprocess.Popen[bytes] | None, log: Path, timeout_s: float,
                 what: str = "the daemon") -> None:
    """Until the daemon at `address` says SERVING to the health check; RuntimeError, with the end of its
    log, if its process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; its log ({log}):\n{log_tail(log)}")
        with contextlib.suppress(grpc.RpcError):
            if health_status(address, 1.0) == "SERVING":
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {timeout_s:g} s; its log ({log}):\n{log_tail(log)}")


class LocalCluster:
    """`with LocalCluster(4, workdir) as c:` N daemons; `c.socket_dir(i)`, `c.token(job)`, `c.kill(i)`."""

    def __init__(self, nodes: int, workdir: str | Path, *, transport: str = "tcp", emulated: Any = None,
                 metrics: bool = True, rendezvous: bool = False, elastic: bool = False, extra: Sequence[str] = (),
                 env: dict[str, str] | None = None, ready_timeout_s: float = 60.0, store_extra: Sequence[str] = (),
                 node_extra: dict[int, Sequence[str]] | None = None):
        if nodes < 1:
            raise ValueError(f"nodes {nodes} must be at least 1")
        self.nodes, self.workdir = nodes, Path(workdir)
        self.transport, self.emulated, self.extra = transport, emulated, list(extra)
        self.ready_timeout_s = ready_timeout_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.workdir / "cluster.secret"
        text = new_secret()  # `zend secret`'s format, as an operator makes it
        self.secret = decode(text.encode(), "LocalCluster")  # the key bytes the daemons derive tokens from
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        hosts = [emulated.address(i) if emulated else "127.0.0.1" for i in range(nodes)]
        ports = [7000 if emulated else free_port() for _ in range(nodes)]
        self.peers = [f"{transport}://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
        self.metrics_ports = [free_port() if metrics and not emulated else 0 for _ in range(nodes)]
        # rendezvous: node 0 hosts torch's TCPStore; nobody is told the others' addresses
        # elastic: torch's elastic rendezvous in a store of its own (`zend store`) that outlives every node
        self.elastic = elastic
        self.store = f"{hosts[0]}:{free_port() if not emulated else 29500}" if rendezvous or elastic else ""
        self.store_proc: subprocess.Popen[bytes] | None = None
        self.store_extra = list(store_extra)  # more flags of `zend store` (elastic)
        self.node_extra = {n: list(flags) for n, flags in (node_extra or {}).items()}  # flags of one node only
        self.env = {**os.environ, **(env or {}), "ZEN_CLUSTER_SECRET_FILE": str(self.secret_file)}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def socket_dir(self, node: int) -> str:
        return str(self.workdir / f"node{node}")

    def log_path(self, node: int) -> Path:
        return self.workdir / f"node{node}.log"

    def token(self, job: str) -> str:
        return job_token(self.secret, job)

    def operator_token(self) -> str:
        """What the Operator service asks for (full Status, Drain, Undrain)."""
        return operator_token(self.secret)

    def argv(self, node: int) -> list[str]:
        membership = ["--rendezvous", self.store, "--listen", self.peers[node]] if self.store else [
            "--peers", ",".join(self.peers)]
        if self.elastic:
            membership += ["--elastic", "1"]
        return [sys.executable, "-m", "zend", "serve", "--rank", str(node), "--world-size", str(self.nodes),
                *membership, "--transport", self.transport,
                "--socket-dir", self.socket_dir(node), "--metrics-port", str(self.metrics_ports[node]),
                "--metrics-host", "127.0.0.1", *self.extra, *self.node_extra.get(node, [])]

    def _popen(self, argv: list[str], host: int, log_path: Path) -> subprocess.Popen[bytes]:
        """A process of the cluster in a session of its own, in host's namespace when emulated, logging to log_path."""
        log = open(log_path, "ab")  # noqa: SIM115 (the child owns it)
        if self.emulated is not None:
            argv = ["ip", "netns", "exec", self.emulated.namespace(host), *argv]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        return proc

    def start_node(self, node: int) -> None:
        self.procs[node] = self._popen(self.argv(node), node, self.log_path(node))

    def start_store(self) -> None:
        """The elastic rendezvous store, in its own process (in node 0's namespace when emulated)."""
        self.store_proc = self._popen([sys.executable, "-m", "zend", "store", "--listen", self.store,
                                       *self.store_extra], 0,
                                      self.workdir / "store.log")
        host, _, port = self.store.rpartition(":")
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections
            if self.store_proc.poll() is not None:
                raise RuntimeError(f"zend store exited with {self.store_proc.returncode}: "
                                   f"{(self.workdir / 'store.log').read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"zend store at {self.store} not up within 30 s") from None
                time.sleep(0.05)

    def __enter__(self) -> LocalCluster:
        try:
            if self.elastic:
                self.start_store()
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
        wait_serving(paths.grpc_address(self.socket_dir(node)), self.procs.get(node), self.log_path(node),
                     timeout_s or self.ready_timeout_s, what=f"zend node {node}")

    def log_tail(self, node: int, lines: int = 30) -> str:
        return log_tail(self.log_path(node), lines)

    def kill(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Signal node's daemon (its process group) and wait for it to end."""
        self.send_signal(node, sig)
        self.procs[node].wait(30)

    def send_signal(self, node: int, sig: int) -> None:
        """Signal node's daemon and return (SIGSTOP / SIGCONT: freeze and thaw it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[node].pid, sig)

    def close(self) -> None:
        procs = [*self.procs.values(), *([self.store_proc] if self.store_proc is not None else [])]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
