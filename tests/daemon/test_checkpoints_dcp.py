"""In-memory checkpoints through torch.distributed.checkpoint (issue 28): real daemons, real trainer processes.

2 nodes x 2 trainers save a model, its Adam state and a DTensor sharded over the ranks every 10 steps
(zen.checkpoint.Checkpointer: DCP with MemoryWriter); new trainer processes (a restart on live nodes)
load the newest complete step with MemoryReader and must get every byte back.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import launch_ranks, node_status, poll_for

pytestmark = pytest.mark.daemon

SCRIPT = "tests/daemon/checkpoint_rank.py"
EXTRA = ["--step-timeout-s", "60", "--peer-timeout-s", "5", "--log-format", "text"]


def outputs(texts: list[str]) -> list[dict]:
    return [json.loads(t.strip().splitlines()[-1]) for t in texts]


@pytest.mark.parametrize(("dtype", "save"), [("float32", "save"), ("bfloat16", "save"), ("float32", "save-async")])
def test_a_restarted_trainer_loads_the_newest_complete_step_bit_exact(fresh_cluster, dtype, save):
    """save-async: DCP's async_save through one kept stager, whose copy of step 10's state step 20 overwrites."""
    c = fresh_cluster(2, extra=EXTRA)
    saved = outputs(launch_ranks(c, [SCRIPT, save, "20", dtype], job="ck", per_node=2, timeout_s=240))
    # step 20 is complete on both nodes, step 10 kept beside it
    for node in range(2):
        status = poll_for(lambda n=node: [x for x in node_status(c, n, operator=True).checkpoints
                                          if x.last_complete_step == 20], 30, f"step 20 complete on node {node}")
        assert list(status[0].steps) == [10, 20]
    loaded = outputs(launch_ranks(c, [SCRIPT, "load", dtype], job="ck", per_node=2, timeout_s=240))
    assert [x["step"] for x in loaded] == [20] * 4
    assert [x["digest"] for x in loaded] == [x["digest"] for x in saved]


ELASTIC = [*EXTRA, "--connect-timeout-s", "60"]


def restart(c, node: int) -> None:  # type: ignore[no-untyped-def]
    c.kill(node)
    c.start_node(node)
    c.wait_ready(node, 90)


def test_a_restarted_daemon_gets_its_checkpoint_back_from_its_peer(fresh_cluster):
    """Elastic: node 1's daemon is killed (its memory gone) and restarted under the same --rank; the new
    generation's census gives it node 1's objects from node 0's copy, and every trainer loads step 20."""
    node_1_gets_step_20_back_from_its_peer(fresh_cluster(2, elastic=True, extra=ELASTIC))


def node_1_gets_step_20_back_from_its_peer(c) -> None:  # type: ignore[no-untyped-def]
    """2 trainers per node save 20 steps; node 1's daemon is killed and restarted under the same --rank; its
    census brings step 20 back, and new trainers load it bit for bit (also run in network namespaces)."""
    saved = outputs(launch_ranks(c, [SCRIPT, "save", "20", "float32"], job="ck", per_node=2, timeout_s=240))
    poll_for(lambda: [x for x in node_status(c, 1, operator=True).checkpoints if x.last_complete_step == 20], 30,
             "step 20 complete on node 1")
    restart(c, 1)
    status = poll_for(lambda: [x for x in node_status(c, 1, operator=True).checkpoints if x.last_complete_step == 20],
                      60, "step 20 recovered on node 1")
    assert status[0].bytes > 0
    loaded = outputs(launch_ranks(c, [SCRIPT, "load", "float32"], job="ck", per_node=2, timeout_s=240))
    assert [x["step"] for x in loaded] == [20] * 4
    assert [x["digest"] for x in loaded] == [x["digest"] for x in saved]


def test_a_checkpoint_whose_every_copy_is_gone_is_refused_naming_the_lost_node(fresh_cluster):
    """No replicas (--checkpoint-replicas 0): node 1's restart loses its objects for good; the load is refused
    on every trainer, naming node 1, rather than loading a partial state or starting from scratch."""
    c = fresh_cluster(2, elastic=True, extra=[*ELASTIC, "--checkpoint-replicas", "0"])
    launch_ranks(c, [SCRIPT, "save", "10", "float32"], job="ck", per_node=2, timeout_s=240)
    poll_for(lambda: [x for x in node_status(c, 1, operator=True).checkpoints if x.last_complete_step == 10], 30,
             "step 10 complete on node 1")
    restart(c, 1)
    with pytest.raises(AssertionError, match=r"node\(s\) \[1\] were on no surviving node"):
        launch_ranks(c, [SCRIPT, "load", "float32"], job="ck", per_node=2, timeout_s=240)
