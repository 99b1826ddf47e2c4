"""Rank processes for transport tests (tests/transport/worker.py), stopped at teardown, also on failure.

Every rank is a process of its own with one transport, the shape the daemons run in; the
same tests run against each `scheme`: tcp:// with the Python data plane, tcp+native (every rank's links
in the native engine), tcp+mixed (odd ranks native, even ranks Python: the two interoperate on one wire)
and ucx://.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.subprocess_env import with_project
from zend.cluster.netns import EmulatedCluster, available

SECRET = b"test-cluster-secret-0123456789"
ROOT = Path(__file__).resolve().parents[2]


class RemoteError(Exception):
    """A command failed inside a rank process; `kind` is the exception's class name there."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class Rank:
    """One rank process: `call(op, **args)` runs a worker command and returns its answer."""

    def __init__(self, rank: int, proc: subprocess.Popen, port: int, host: str):
        self.rank, self.proc, self.port, self.host = rank, proc, port, host
        self._ids = itertools.count()
        self._answers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._chatter: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                self._chatter.append(line)  # libraries' output, kept for failure messages
                continue
            answer = json.loads(line)
            with self._cond:
                self._answers[answer["id"]] = answer
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def start(self, op: str, **args: Any) -> int:
        """Send a command without waiting; `wait(id)` collects its answer."""
        ident = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": ident, "op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return ident

    def wait(self, ident: int, timeout_s: float = 60.0) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: ident in self._answers or self.proc.poll() is not None, timeout_s):
                raise TimeoutError(f"rank {self.rank}: no answer to command {ident} in {timeout_s} s")
            if ident not in self._answers:
                raise RuntimeError(f"rank {self.rank} exited with {self.proc.wait()}: {''.join(self._chatter)[-2000:]}")
            answer = self._answers.pop(ident)
        if "error" in answer:
            raise RemoteError(answer["type"], answer["error"])
        return answer

    def call(self, op: str, wait_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Run a command and wait up to wait_s for its answer (args may carry the command's own timeout_s)."""
        return self.wait(self.start(op, **args), wait_s)

    def exit(self) -> int:
        """Close the transport and wait for the process to end; its exit code."""
        if self.proc.poll() is None:
            self.call("exit", wait_s=15)
        return self.proc.wait(15)


def call_all(ranks: list[Rank], op: str, wait_s: float = 60.0, **args: Any) -> list[dict[str, Any]]:
    """The same command on every rank at once; their answers (the first failure is raised)."""
    idents = [r.start(op, **args) for r in ranks]
    return [r.wait(i, wait_s) for r, i in zip(ranks, idents, strict=True)]


def peer_table(ranks: list[Rank]) -> dict[str, list]:
    return {str(r.rank): list(r.address) for r in ranks}


class RankProcesses:
    """Starts rank processes for one test; kills whatever is still running at teardown."""

    def __init__(self, scheme: str):
        self.scheme, _, self.engines = scheme.partition("+")  # "tcp+native" -> tcp://, every rank native
        self.procs: list[subprocess.Popen] = []

    def engine(self, rank: int) -> str:
        """The data-plane engine of rank `rank`: mixed pairs put odd ranks on the native engine."""
        if self.engines == "native" or (self.engines == "mixed" and rank % 2 == 1):
            return "native"
        return "python"

    def launch(self, rank: int, world_size: int, *, host: str = "127.0.0.1", cluster: EmulatedCluster | None = None,
               secret: bytes = SECRET, **options: Any) -> subprocess.Popen:
        """Start the process of rank `rank` on loopback, or inside host `rank` of an emulated cluster.

        options: cluster_id, generation, protocol_version, timeout_s, max_buffered_bytes, security.
        """
        env = with_project(ZEN_CLUSTER_SECRET=secret.decode())
        argv = [sys.executable, "-m", "tests.transport.worker", "--uri", f"{self.scheme}://{host}:0",
                "--rank", str(rank), "--world-size", str(world_size), "--engine", self.engine(rank)]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        if cluster is None:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        else:  # hosts share this machine: UCX must not take shared memory past the shaped links
            env["UCX_TLS"] = "tcp"
            proc = cluster.popen(rank, argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.procs.append(proc)
        return proc

    @staticmethod
    def ready(rank: int, proc: subprocess.Popen, host: str) -> Rank:
        """Wait for a launched rank to print its port."""
        assert proc.stdout is not None
        seen = []
        while not (line := proc.stdout.readline()).startswith("PORT "):  # skip libraries' chatter
            seen.append(line)
            assert line and len(seen) < 50, f"rank {rank} never printed its port (exit {proc.poll()}): {seen}"
        return Rank(rank, proc, int(line.split()[1]), host)

    def start(self, rank: int, world_size: int, host: str = "127.0.0.1", **options: Any) -> Rank:
        return self.ready(rank, self.launch(rank, world_size, host=host, **options), host)

    def let_in(self, good: Rank, seed: int, connect_timeout_s: float = 20, **options: Any) -> float:
        """Rank 1 dials `good` (rank 0 of 2, after whatever a test did to it) and a message crosses
        intact; returns the seconds rank 1's connect took (its process start not counted)."""
        linking = good.start("connect", peers={"0": list(good.address), "1": ["127.0.0.1", 1]}, timeout_s=30)
        right = self.start(1, 2, **options)
        started = time.monotonic()
        right.call("connect", peers={"0": list(good.address), "1": list(right.address)}, timeout_s=connect_timeout_s)
        good.wait(linking)
        took = time.monotonic() - started
        right.call("send", dst=0, tag="in", seeds=[seed], size=64)
        assert good.call("recv", src=1, tag="in", seeds=[seed], size=64)["intact"] == [True]
        return took

    def mesh(self, n: int, connect: bool = True, cluster: EmulatedCluster | None = None, **options: Any) -> list[Rank]:
        """n rank processes (started side by side), connected to each other unless connect=False."""
        hosts = [cluster.address(r) if cluster else "127.0.0.1" for r in range(n)]
        procs = [self.launch(r, n, host=hosts[r], cluster=cluster, **options) for r in range(n)]
        ranks = [self.ready(r, proc, hosts[r]) for r, proc in enumerate(procs)]
        if connect:
            call_all(ranks, "connect", peers=peer_table(ranks))
        return ranks

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


# ZEN_TEST_SCHEMES narrows them: `make test` leaves tcp+native to `make native-check`, which runs it on
# the sanitized build of the engine
SCHEMES = os.environ.get("ZEN_TEST_SCHEMES", "tcp,tcp+native,tcp+mixed,ucx").split(",")


@pytest.fixture(scope="module", params=SCHEMES)
def scheme(request) -> str:  # type: ignore[no-untyped-def]
    """The transport under test: every test here runs against each backend and engine."""
    if request.param == "ucx":
        pytest.importorskip("ucxx", reason="ucxx is not installed (install the `ucx` extra)")
    if request.param.startswith("tcp+"):
        pytest.importorskip("zend._engine", reason="the native engine is not built (pip install -e . builds it)")
    return request.param


@pytest.fixture
def processes(scheme) -> Iterator[RankProcesses]:  # type: ignore[no-untyped-def]
    procs = RankProcesses(scheme)
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def mesh8(scheme) -> Iterator[list[Rank]]:  # type: ignore[no-untyped-def]
    """Eight connected ranks shared by the tests of a module that leave them intact (own tags)."""
    procs = RankProcesses(scheme)
    try:
        yield procs.mesh(8)
    finally:
        procs.stop()


@pytest.fixture
def emulated_cluster() -> Iterator[Callable[..., EmulatedCluster]]:
    """emulated_cluster(n, rate_mbit=...) -> an EmulatedCluster, removed at teardown."""
    reason = available()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    made: list[EmulatedCluster] = []

    def make(n: int, **options) -> EmulatedCluster:  # type: ignore[no-untyped-def]
        cluster = EmulatedCluster(n, **options).__enter__()
        made.append(cluster)
        return cluster

    yield make
    for c in made:
        c.close()
