"""GEMINI's group placement of checkpoint copies (zend/daemon/checkpoint_placement.py): groups, who holds whose
objects, and which losses of nodes a checkpoint survives (checked exhaustively on small clusters)."""

from __future__ import annotations

from itertools import combinations

import pytest

from zend.daemon.checkpoint_placement import groups, held_by, replica_peers

pytestmark = pytest.mark.inprocess

SIZES = range(1, 13)
REPLICAS = range(0, 5)


def copies(rank: int, n: int, replicas: int) -> set[int]:
    """Every node holding `rank`'s objects, itself included."""
    return {rank, *replica_peers(rank, n, replicas)}


@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", SIZES)
def test_groups_partition_the_ranks_into_consecutive_runs_of_m_to_2m_minus_1(n: int, replicas: int) -> None:
    gs = groups(n, replicas)
    assert [r for g in gs for r in g] == list(range(n))  # every rank once, in order
    m = min(replicas + 1, n)
    for g in gs:
        assert g == list(range(g[0], g[0] + len(g)))
        assert m <= len(g) <= 2 * m - 1, (g, m)
    assert all(len(g) == m for g in gs[:-1])  # only the last group takes the remainder
    assert len(gs) == n // m


@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", SIZES)
def test_each_ranks_objects_go_to_replicas_distinct_other_ranks_of_its_group(n: int, replicas: int) -> None:
    for rank in range(n):
        peers = replica_peers(rank, n, replicas)
        assert rank not in peers
        assert len(set(peers)) == len(peers)
        assert all(0 <= p < n for p in peers)
        (group,) = [g for g in groups(n, replicas) if rank in g]
        assert set(peers) <= set(group)
        if n >= replicas + 1:
            assert len(peers) == replicas, (rank, peers)
        else:
            assert set(peers) == set(range(n)) - {rank}


@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", SIZES)
def test_held_by_is_the_inverse_of_replica_peers(n: int, replicas: int) -> None:
    pairs = {(rank, peer) for rank in range(n) for peer in replica_peers(rank, n, replicas)}
    held = {(source, holder) for holder in range(n) for source in held_by(holder, n, replicas)}
    assert pairs == held
    for holder in range(n):  # each node holds as many nodes' objects as hold its own: the load is even
        assert len(held_by(holder, n, replicas)) == len(replica_peers(holder, n, replicas))


def test_the_placement_of_small_clusters() -> None:
    assert groups(4, 1) == [[0, 1], [2, 3]]
    assert [replica_peers(r, 4, 1) for r in range(4)] == [(1,), (0,), (3,), (2,)]
    assert groups(5, 1) == [[0, 1], [2, 3, 4]]
    assert [replica_peers(r, 5, 1) for r in range(5)] == [(1,), (0,), (3,), (4,), (2,)]  # a ring in 2, 3, 4
    assert [held_by(r, 5, 1) for r in range(5)] == [(1,), (0,), (4,), (2,), (3,)]
    assert groups(7, 2) == [[0, 1, 2], [3, 4, 5, 6]]
    assert replica_peers(6, 7, 2) == (3, 4)
    assert held_by(3, 7, 2) == (5, 6)


@pytest.mark.parametrize("n", SIZES)
def test_no_replicas_means_no_peers(n: int) -> None:
    assert groups(n, 0) == [[r] for r in range(n)]
    for rank in range(n):
        assert replica_peers(rank, n, 0) == ()
        assert held_by(rank, n, 0) == ()


@pytest.mark.parametrize(("n", "replicas"), [(1, 1), (2, 1), (2, 5), (3, 2), (3, 3), (4, 9)])
def test_fewer_nodes_than_copies_means_everyone_holds_everyone(n: int, replicas: int) -> None:
    assert groups(n, replicas) == [list(range(n))]
    for rank in range(n):
        assert sorted(replica_peers(rank, n, replicas)) == [r for r in range(n) if r != rank]
        assert sorted(held_by(rank, n, replicas)) == [r for r in range(n) if r != rank]


def ring_run_lost(group: list[int], m: int, lost: set[int]) -> bool:
    """`lost` holds m cyclically consecutive members of the ring `group` (a node's objects and their copies)."""
    return any(all(group[(i + k) % len(group)] in lost for k in range(m)) for i in range(len(group)))


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("n", range(1, 8))
def test_a_checkpoint_survives_every_loss_that_takes_no_whole_group(n: int, replicas: int) -> None:
    """Exhaustively: a loss of nodes leaves a copy of every node's objects unless it takes a whole full group,
    or, in a remainder group of more than m nodes (placed as a ring), m consecutive members of it. In
    particular, any `replicas` lost nodes (short of all of them) lose nothing."""
    gs = groups(n, replicas)
    m = min(replicas + 1, n)
    for size in range(n + 1):
        for lost in map(set, combinations(range(n), size)):
            anything_lost = any(copies(rank, n, replicas) <= lost for rank in range(n))
            takes_a_group = any(set(g) <= lost for g in gs)
            takes_a_ring_run = any(len(g) > m and ring_run_lost(g, m, lost) for g in gs)
            assert anything_lost == (takes_a_group or takes_a_ring_run), (n, replicas, sorted(lost))
            if size <= min(replicas, n - 1) or (not takes_a_group and all(len(g) == m for g in gs)):
                assert not anything_lost, (n, replicas, sorted(lost))


def test_losing_part_of_a_remainder_group_can_lose_a_nodes_objects() -> None:
    """The ring of a remainder group tolerates `replicas` losses in it, not any loss short of the whole group:
    with n=5, replicas=1, node 2's objects are on nodes 2 and 3 only."""
    assert [2, 3, 4] in groups(5, 1)
    lost = {2, 3}  # short of the group
    assert [r for r in range(5) if copies(r, 5, 1) <= lost] == [2]
    assert [r for r in range(5) if copies(r, 5, 1) <= {2, 4}] == [4]  # in a ring of 3, any two are adjacent
    assert not [r for r in range(5) if copies(r, 5, 1) <= {0, 2}]  # one node of each group


@pytest.mark.parametrize(("n", "replicas"), [(0, 1), (-1, 0), (3, -1)])
def test_a_bad_size_or_replica_count_is_refused(n: int, replicas: int) -> None:
    with pytest.raises(ValueError, match=f"n={n}, replicas={replicas}"):
        groups(n, replicas)


@pytest.mark.parametrize("rank", [-1, 4, 10])
def test_a_rank_outside_the_cluster_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank {rank} is not in \[0, 4\)"):
        replica_peers(rank, 4, 1)
