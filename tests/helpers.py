"""What the test modules share: waiting on observable state (`poll_for`), running trainers side by side
(`run_all`), trainer processes against a local cluster (`launch_ranks`), a daemon's Status (`node_status`),
and the seeded gradients the daemon tests sum (`random_grad`).

A test that waits for something waits for it here, on state it can see (a Status field, a log line, a
file, a counter), never for a fixed time: a fixed sleep is too short on a loaded machine and too long
everywhere else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import torch

from tests.subprocess_env import project_path
from zend.core.sparse import SparseGrad
from zend.protocol.step import StepFailed

if TYPE_CHECKING:
    from zend.api.zen.v1 import zen_pb2 as pb
    from zend.cluster.local import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def poll_for(predicate: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.05,
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call `predicate` until it returns a truthy value, and return that value.

    Raises AssertionError naming `what` and the predicate's last value once `timeout_s` has passed.
    An exception of a type in `ignore` counts as "not yet" (and is the last value the message names);
    any other exception is raised at once. Polls every `interval_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        last: object
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what} (last: {last!r})")
        time.sleep(interval_s)


def run_all(bodies: list[Callable[[], Any]], timeout_s: float = 120.0) -> list[Any]:
    """Run the bodies at once on threads; return their results or exceptions, in order."""
    results: list[Any] = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a trainer thread is still running"
    return results


def status_code(result: Any) -> str:
    """The status name of a failed call: a step's (StepFailed, whichever way it went) or another RPC's;
    fails if `result` is neither."""
    if isinstance(result, StepFailed):
        return result.code
    assert isinstance(result, grpc.RpcError), f"expected an RPC error or a failed step, got {result!r}"
    return result.code().name  # type: ignore[no-any-return]


def status_details(result: Any) -> str:
    """The daemon's words of a failed call (as status_code)."""
    if isinstance(result, StepFailed):
        return result.message
    assert isinstance(result, grpc.RpcError), f"expected an RPC error or a failed step, got {result!r}"
    return result.details() or ""


def random_grad(rows: int, dim: int, seed: int, dtype: torch.dtype = torch.float32) -> SparseGrad:
    """A seeded gradient of a (rows, dim) table: up to rows / 2 rows, duplicates on purpose (the daemon coalesces)."""
    g = torch.Generator().manual_seed(seed)
    nnz = int(torch.randint(0, rows // 2, (1,), generator=g))
    idx = torch.randint(0, rows, (nnz,), generator=g)
    return SparseGrad(idx, torch.randn(nnz, dim, generator=g).to(dtype), rows)


def node_status(c: LocalCluster, node: int, operator: bool = False) -> pb.StatusReply:
    """Node `node`'s Status: redacted (as anyone on the node sees it), or in full with the operator token."""
    from zend.api.zen.v1 import zen_pb2 as pb
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
    from zend.protocol import paths

    metadata = (("authorization", f"Bearer {c.operator_token()}"),) if operator else None
    with grpc.insecure_channel(paths.grpc_address(c.socket_dir(node))) as channel:
        return pb_grpc.OperatorStub(channel).Status(pb.StatusRequest(), timeout=10, metadata=metadata)


def steps_in_flight(c: LocalCluster, node: int) -> int:
    """Steps node `node` has opened and not finished (a step waiting for a trainer or a peer counts)."""
    return int(node_status(c, node).steps_in_flight)


class RankCrashed(AssertionError):
    """A rank died by a signal (returncode < 0); its Python stack, if any, is in the message (faulthandler)."""


def launch_ranks(cluster: LocalCluster, script: list[str], job: str, per_node: int = 1, timeout_s: float = 300,
                 env: dict[str, str] | None = None) -> list[str]:
    """Run one process per rank (torchrun's variables + the sidecar's ZEN_* ones, then `env`); return
    their outputs."""
    from zend.cluster.launcher import rank_env
    from zend.cluster.local import free_port

    port = free_port()
    procs = []
    for node in range(cluster.nodes):
        for local in range(per_node):
            rank_vars = {**os.environ, **rank_env(node, local, cluster.nodes, per_node, port, cluster, job),
                         "PYTHONPATH": project_path(),  # ahead of what was there (carried wheels, on a GPU machine)
                         "PYTHONFAULTHANDLER": "1", **(env or {})}  # a crash prints its stack
            procs.append(subprocess.Popen([sys.executable, *script], env=rank_vars, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            results.append(p.communicate(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:  # a hang: every rank's Python stacks (faulthandler on SIGABRT) say where
        stacks = []
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                err = "(no answer to SIGABRT)"
            stacks.append(f"--- rank {rank} (exit {p.returncode}):\n{(err or '')[-4000:]}")
        raise AssertionError(f"ranks of {script} still running after {timeout_s:g} s:\n" + "\n".join(stacks)) \
            from None
    finally:
        for p in procs:
            p.kill()
    # a rank that died by a signal is the cause; the others then fail on their broken process group
    for rank, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        if p.returncode < 0:
            raise RankCrashed(f"rank {rank} died by signal {-p.returncode}:\n{err[-3000:]}")
    for rank, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [out for out, _ in results]
