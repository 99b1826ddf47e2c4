"""A node replaced in network namespaces gets its in-memory checkpoint back from its peer (issue 28's
"restore after replacing a node (network namespaces)"): two elastic daemons, each in a namespace of its
own behind the emulated bridge at 10 Gbit/s, 2 trainers each save a model, its Adam state and a sharded
DTensor every 10 steps; node 1's daemon is killed -9 (its memory gone) and a new one takes rank 1 in the
same namespace; the new generation's census brings node 1's objects back over the data plane, and new
trainers load step 20 bit for bit. (tests/daemon/test_checkpoints_dcp.py does the same on loopback.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.test_checkpoints_dcp import ELASTIC, node_1_gets_step_20_back_from_its_peer
from zend.cluster.local import LocalCluster

pytestmark = pytest.mark.netns


@pytest.fixture
def cluster_in_namespaces(tmp_path: Path) -> Iterator[LocalCluster]:
    from zend.cluster.netns import EmulatedCluster, available

    reason = available()
    if reason:
        pytest.skip(f"network namespaces: {reason}")
    with EmulatedCluster(2, rate_mbit=10_000) as emulated, \
            LocalCluster(2, tmp_path, emulated=emulated, elastic=True, extra=ELASTIC) as c:
        yield c


@pytest.mark.timeout(420)
def test_a_replaced_node_in_namespaces_gets_its_checkpoint_back_from_its_peer(
        cluster_in_namespaces: LocalCluster) -> None:
    node_1_gets_step_20_back_from_its_peer(cluster_in_namespaces)
