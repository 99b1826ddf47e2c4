"""Fixtures for real zend daemons: every process, socket folder and namespace is cleaned up."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from zend.cluster.local import LocalCluster
from zend.protocol.step import StepFailed


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
    """The status name of a failed call: a step's (StepFailed, whichever way it went) or another RPC's."""
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


@pytest.fixture(scope="module")
def cluster4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four daemons on loopback (tcp://), shared by a module's tests."""
    with LocalCluster(4, tmp_path_factory.mktemp("zend4"), extra=["--step-timeout-s", "20", "--peer-timeout-s",
                                                                   "10", "--log-format", "json"]) as c:
        yield c


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """A factory of clusters that live for one test."""
    made: list[LocalCluster] = []

    def make(nodes: int, **kwargs: Any) -> LocalCluster:
        c = LocalCluster(nodes, tmp_path / f"c{len(made)}", **kwargs)
        made.append(c)
        return c.__enter__()

    yield make
    for c in made:
        c.close()
