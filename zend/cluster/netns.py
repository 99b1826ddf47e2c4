"""An emulated multi-node cluster on one machine, for tests and benchmarks.

N network namespaces ("hosts"), each with one interface on a bridge that lives in a hub
namespace of its own (the machine's own network is never touched). Addresses come from
198.18.0.0/15, the benchmarking range. Each host's link can be shaped with tc (tbf for the
rate, netem for a delay where the kernel has it) in both directions: on the host side for
what it sends, on the hub side for what it receives. Everything is removed on exit, also
when the body raises. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from types import TracebackType

SUBNET_PREFIX = "198.18.0."


def available() -> str | None:
    """None if an emulated cluster can be built here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2 ({tool} not found)"
    return None


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


class EmulatedCluster:
    """`with EmulatedCluster(4, rate_mbit=1000, delay_ms=0.5) as c: c.popen(0, [...])`."""

    def __init__(self, nodes: int, rate_mbit: float | None = None, delay_ms: float = 0.0):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes {nodes} outside [1, 200]")
        reason = available()
        if reason:
            raise RuntimeError(f"emulated cluster: {reason}")
        self.nodes = nodes
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = f"zen{secrets.token_hex(3)}"  # per run: parallel runs never collide
        self.hub = f"{self.prefix}-hub"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []

    def address(self, node: int) -> str:
        return f"{SUBNET_PREFIX}{node + 1}"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def __enter__(self) -> EmulatedCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _shape(self, ns: str, dev: str) -> None:
        """tbf for the rate; netem, where the kernel has it, for the delay (in front of tbf)."""
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.delay_ms:
            _run(*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms", "limit", "100000")
            parent = ["parent", "1:1"]
        if self.rate_mbit is not None:
            # burst: at least one 64 KiB segment; queue up to 50 ms at the rate
            burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 250))
            _run(*tc, *parent, "handle", "10:", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst),
                 "latency", "50ms")

    def _build(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.namespace(i)
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # create the pair inside the hub, then move one end into the host namespace
            _run("ip", "-n", self.hub, "link", "add", f"h{i}", "type", "veth", "peer", "name", f"e{i}")
            _run("ip", "-n", self.hub, "link", "set", f"e{i}", "netns", ns)
            _run("ip", "-n", ns, "link", "set", f"e{i}", "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", f"h{i}", "up")
            self._shape(ns, "eth0")  # what host i sends
            self._shape(self.hub, f"h{i}")  # what host i receives

    def popen(self, node: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        """Start a process inside host `node`; it is killed when the cluster closes."""
        proc: subprocess.Popen[str] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(node), *argv], text=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.procs.clear()
        for ns in reversed(self.namespaces):  # deleting a namespace deletes its interfaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
