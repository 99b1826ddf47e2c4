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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_restarted_trainer_loads_the_newest_complete_step_bit_exact(fresh_cluster, dtype):
    c = fresh_cluster(2, extra=EXTRA)
    saved = outputs(launch_ranks(c, [SCRIPT, "save", "20", dtype], job="ck", per_node=2, timeout_s=240))
    # step 20 is complete on both nodes, step 10 kept beside it
    for node in range(2):
        status = poll_for(lambda n=node: [x for x in node_status(c, n, operator=True).checkpoints
                                          if x.last_complete_step == 20], 30, f"step 20 complete on node {node}")
        assert list(status[0].steps) == [10, 20]
    loaded = outputs(launch_ranks(c, [SCRIPT, "load", dtype], job="ck", per_node=2, timeout_s=240))
    assert [x["step"] for x in loaded] == [20] * 4
    assert [x["digest"] for x in loaded] == [x["digest"] for x in saved]
