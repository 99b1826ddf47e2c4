"""Where the job is, known after any restart (--elastic 1): every daemon killed and restarted while the
trainers live on, one trainer a step behind the others (it lost its last result) no longer deadlocks
(each node waiting at its own step for ever): the daemons notice a step waiting beyond what their
generation knows, form a generation that agrees on the highest, the trainer behind is told so
(OutOfOrder, with the step to resume from), and the job goes on with correct sums. A trainer that
joins a running generation is told the step the job has reached, not the one it formed at."""

from __future__ import annotations

import time

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


def test_all_daemons_restarted_and_a_trainer_a_step_behind_the_job_goes_on(fresh_cluster):
    c = fresh_cluster(2, elastic=True, extra=EXTRA)
    survivor, lost = client(c, 1), client(c, 0)
    try:
        for step in range(5):  # steps 0-4 everywhere
            outs = run_all([lambda z=z, n=n, s=step: z.allreduce(grad(s, n), name="emb", step=s)
                            for n, z in ((0, lost), (1, survivor))])
            for out in outs:
                torch.testing.assert_close(out.to_dense(), expected(step))
        lost.close()  # node 0's trainer dies, having lost step 4's result: it restarts from step 4
        c.kill(0)
        c.kill(1)  # both daemons, before a new generation formed: nobody remembers step 5
        c.start_node(0)
        c.start_node(1)
        for node in range(2):
            c.wait_ready(node, 90)
        restarted = client(c, 0)
        told: dict[str, object] = {}

        def behind() -> torch.Tensor:
            step = 4  # its checkpoint
            for _ in range(6):
                try:
                    return restarted.allreduce(grad(step, 0), name="emb", step=step)
                except zen.OutOfOrder as exc:  # told where the job is: resume there (from a checkpoint)
                    told["out_of_order"], step = str(exc), restarted.job_step
                except (zen.StepAborted, zen.DaemonUnavailable):
                    try:
                        restarted.wait_ready(90)
                    except zen.OutOfOrder as exc:
                        told["out_of_order"], step = str(exc), restarted.job_step
            raise AssertionError("node 0 never got a sum")

        def ahead() -> torch.Tensor:
            for _ in range(6):
                try:
                    return survivor.allreduce(grad(5, 1), name="emb", step=5)
                except (zen.StepAborted, zen.DaemonUnavailable):
                    survivor.wait_ready(90)
            raise AssertionError("node 1 never got a sum")

        t0 = time.monotonic()
        got = run_all([behind, ahead], timeout_s=100)
        took = time.monotonic() - t0
        for out in got:
            assert isinstance(out, torch.Tensor), got
            torch.testing.assert_close(out.to_dense(), expected(5))
        assert "the job is at step 5" in str(told.get("out_of_order")), told
        assert restarted.job_step == 5
        assert took < 60, f"the job went on only after {took:.1f} s (the step timeout is 120 s)"
        print(f"both daemons restarted, a trainer a step behind: next good step after {took:.1f} s")
    finally:
        survivor.close()
        lost.close()


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
