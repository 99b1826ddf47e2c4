"""Generation changes decided by pure functions (zend/daemon/generations.py): what the node does for what it sees."""

from __future__ import annotations

import pytest

from zend.daemon.generations import Regenerate, Stay, View, decide, may_stand
from zend.daemon.membership import Membership

pytestmark = pytest.mark.inprocess


def view(**change: object) -> View:
    base = {"generation": 4, "members": (0, 1, 2), "waiting": 0, "round_intact": True, "down_for": {},
            "min_nodes": 3, "world_size": 3, "dead_after_s": 3.0}
    return View(**{**base, **change})  # type: ignore[arg-type]


def test_a_waiting_daemon_or_a_round_the_others_left_forms_the_next_generation() -> None:
    assert decide(view()) == Stay()
    assert decide(view(waiting=1)) == Regenerate("1 node(s) waiting to join generation 4")
    assert isinstance(decide(view(round_intact=False)), Regenerate)


def test_without_min_nodes_a_lost_node_is_waited_for_however_long() -> None:
    assert decide(view(down_for={2: 3600.0})) == Stay()


def test_scale_in_drops_a_node_only_after_the_dead_time_and_never_below_min_nodes() -> None:
    assert decide(view(min_nodes=2, down_for={2: 2.9})) == Stay()  # a freeze shorter than the dead time
    action = decide(view(min_nodes=2, down_for={2: 3.0}))
    assert isinstance(action, Regenerate) and "--rank 2 lost for 3 s" in action.reason
    assert decide(view(min_nodes=2, down_for={1: 9.0, 2: 9.0})) == Stay()  # 1 node left < min_nodes 2


def test_a_smaller_generation_may_not_leave_out_a_node_reached_within_the_dead_time() -> None:
    smaller = Membership(0, 2, {0: "tcp://a:1", 1: "tcp://b:1"}, 5, "zen", {}, "elastic", members=(0, 1))
    reached = {0: 100.0, 1: 100.0, 2: 98.0}
    refused = may_stand((0, 1, 2), smaller, reached, now=100.0, dead_after_s=3.0)
    assert refused is not None and "leaves out --rank 2" in refused
    assert may_stand((0, 1, 2), smaller, reached, now=101.5, dead_after_s=3.0) is None  # out of reach 3.5 s
    assert may_stand((0, 1, 2), smaller, {}, now=0.0, dead_after_s=3.0) is None  # never reached
