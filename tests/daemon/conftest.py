"""Fixtures for real zend daemons: every process, socket folder and namespace is cleaned up."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zend.cluster.local import LocalCluster


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
