"""Where the job is (--elastic 1): a trainer that joins a running generation is told the step the job has
reached, not the one the generation formed at."""

from __future__ import annotations

import pytest
import torch
import zen

from tests.helpers import random_grad, run_all

pytestmark = pytest.mark.daemon

EXTRA = ["--peer-timeout-s", "2", "--step-timeout-s", "120", "--log-format", "text", "--connect-timeout-s", "60"]
ROWS, WIDTH = 200, 4


def grad(step: int, node: int) -> torch.Tensor:
    return random_grad(ROWS, WIDTH, 1000 * step + node).to_torch_sparse()


def expected(step: int) -> torch.Tensor:
    return sum(random_grad(ROWS, WIDTH, 1000 * step + n).to_dense() for n in range(2))  # type: ignore[return-value]


def client(c, node: int) -> zen.Client:  # type: ignore[no-untyped-def]
    return zen.Client(c.socket_dir(node), job="j", token=c.token("j"), local_rank=0, local_world_size=1,
                      timeout_s=60)


def test_a_trainer_joining_a_running_generation_is_told_the_step_the_job_reached(fresh_cluster):
    c = fresh_cluster(2, elastic=True, extra=EXTRA)
    trainers = [client(c, n) for n in range(2)]
    try:
        for step in range(7):
            run_all([lambda z=z, n=n, s=step: z.allreduce(grad(s, n), name="emb", step=s)
                     for n, z in enumerate(trainers)])
        trainers[0].close()
        joined = client(c, 0)  # a trainer-only restart: the generation is the one that formed at step 0
        trainers[0] = joined
        assert joined.job_step == 7, joined.job_step
        outs = run_all([lambda z=z, n=n: z.allreduce(grad(7, n), name="emb", step=7) for n, z in enumerate(trainers)])
        for out in outs:
            torch.testing.assert_close(out.to_dense(), expected(7))
    finally:
        for z in trainers:
            z.close()
