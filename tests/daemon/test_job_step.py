"""Where the job is (--elastic 1): a trainer that joins a running generation is told the step the job has
reached, not the one the generation formed at."""

from __future__ import annotations

import pytest
import torch
import zen

from tests.helpers import poll_for, random_grad, run_all

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


def test_after_every_daemon_restarted_a_trainer_a_step_behind_is_told_where_the_job_is(fresh_cluster):
    """The drill's deadlock: node 0's trainer lost step 7's result (killed just after it was delivered),
    then both daemons were killed -9 and restarted: no daemon remembers where the job is, node 0's trainer
    comes back at step 7 and node 1's at step 8. Before, each waited for the other at its own step until
    the step timeout, again after every redo, for ever. Now node 0 fails its step at once saying where the
    job is; its trainer, as the README's loop does (StepAborted: wait_ready; OutOfOrder: resume at
    job_step), resumes at step 8, and the step runs once on both nodes with the right sum."""
    import time

    c = fresh_cluster(2, elastic=True, extra=EXTRA)
    trainers = [client(c, n) for n in range(2)]
    try:
        for step in range(8):
            run_all([lambda z=z, n=n, s=step: z.allreduce(grad(s, n), name="emb", step=s)
                     for n, z in enumerate(trainers)])
        for z in trainers:
            z.close()
        for node in range(2):
            c.kill(node)
        for node in range(2):
            c.start_node(node)
        for node in range(2):
            c.wait_ready(node, 120)
        trainers = [client(c, n) for n in range(2)]
        assert [z.job_step for z in trainers] == [0, 0]  # nobody remembers

        def behind() -> tuple[torch.Tensor, list[str]]:
            seen = []
            try:
                trainers[0].allreduce(grad(7, 0), name="emb", step=7)
            except zen.StepAborted as exc:
                seen.append(f"aborted: {exc}")
            try:
                trainers[0].wait_ready(60)
            except zen.OutOfOrder as exc:
                seen.append(f"out of order at {trainers[0].job_step}: {exc}")
            step = trainers[0].job_step
            return trainers[0].allreduce(grad(step, 0), name="emb", step=step), seen

        t0 = time.monotonic()
        (out0, seen), out1 = run_all([behind, lambda: trainers[1].allreduce(grad(8, 1), name="emb", step=8)])
        took = time.monotonic() - t0
        assert len(seen) == 2 and "node 1 is at step 8" in seen[0] and seen[1].startswith("out of order at 8"), seen
        for out in (out0, out1):
            torch.testing.assert_close(out.to_dense(), expected(8))
        assert took < 30, f"{took:.1f} s: the nodes waited on each other (the step timeout is 120 s)"
    finally:
        for z in trainers:
            z.close()


def test_a_whole_job_restarted_on_live_daemons_goes_on_where_each_tensor_is_without_naming_steps(fresh_cluster):
    """Every trainer restarted at once (torchrun restarting a failed job, a job resubmitted), the daemons alive:
    the new trainers' first steps, numbered by the client (as DDP's backend and hook do), are each tensor's next
    step on the daemons, not 0, which the daemons had synchronised already (every trainer got OutOfOrder, and a
    loop that resumes from a checkpoint got it again at every step). Tensors stepped unequally keep their own."""
    c = fresh_cluster(2, elastic=True, extra=EXTRA)
    trainers = [client(c, n) for n in range(2)]
    try:
        for step in range(5):  # "emb" at every iteration, "head" at the first three only
            run_all([lambda z=z, n=n, s=step: z.allreduce(grad(s, n), name="emb") for n, z in enumerate(trainers)])
            if step < 3:
                run_all([lambda z=z, n=n, s=step: z.allreduce(grad(s, n), name="head")
                         for n, z in enumerate(trainers)])
        for z in trainers:
            z.close()
        trainers = [client(c, n) for n in range(2)]
        for name, at in (("emb", 5), ("head", 3)):
            outs = run_all([lambda z=z, n=n, name=name, at=at: z.allreduce(grad(at, n), name=name)
                            for n, z in enumerate(trainers)])
            for out in outs:
                assert isinstance(out, torch.Tensor), out
                torch.testing.assert_close(out.to_dense(), expected(at))
            assert [z._tensors[name].next_step for z in trainers] == [at + 1, at + 1]
            assert [z.last_stats(name).step for z in trainers] == [at, at]  # type: ignore[union-attr]
    finally:
        for z in trainers:
            z.close()


CHILD = r'''
import sys, torch, zen
z = zen.Client(sys.argv[1], job="j", token=sys.argv[2], local_rank=0, local_world_size=1, timeout_s=60)
value = lambda v: torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.full((2, 4), float(v)), (200, 4))
for _ in range(3):
    z.allreduce(value(1), name="emb")
print("3 steps", flush=True)
z.allreduce(value(1000), name="emb")  # step 3 starts on node 0, and waits for node 1's trainer, which is gone
'''


def test_a_step_running_when_every_trainer_of_its_node_died_is_aborted_not_joined_by_the_next_life(fresh_cluster):
    """A job whose trainers all died (torchrun restarts it): node 0's step 3 had started with its dead trainer's
    part and waited for node 1, whose trainer died before step 3. The new trainers are told step 3 (the tensor's
    next step) and must sum their own parts: the daemons abort a step still running when the last trainer of its
    job on a node leaves, instead of letting a new trainer join it (its sum was 1000 + 20, the dead part in it).
    Node 1 never opened that step, yet it was told of the abort: both nodes open the new life's step 3 as its
    next attempt, and the new trainers' first step succeeds (before, node 1 opened the aborted attempt again,
    and its trainer's first step failed with the dead life's abort: a script with no redo loop died of it)."""
    import subprocess
    import sys
    import time

    c = fresh_cluster(2, elastic=True, extra=EXTRA)
    child = subprocess.Popen([sys.executable, "-c", CHILD, c.socket_dir(0), c.token("j")], stdout=subprocess.PIPE,
                             text=True)
    trainers: list[zen.Client] = []
    try:
        node1 = client(c, 1)
        trainers.append(node1)
        for _ in range(3):
            node1.allreduce(torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.full((2, 4), 2.0), (ROWS, WIDTH)),
                            name="emb")
        assert child.stdout is not None and child.stdout.readline().strip() == "3 steps"
        time.sleep(1.0)  # node 0's step 3 has started (one trainer per node: its part starts it)
        node1.close()  # node 1's trainer dies before its step 3, then node 0's, its step running
        child.kill()
        child.wait()
        poll_for(lambda: "left while it ran" in c.log_path(0).read_text(), 30,
                 "node 0 aborting the running step")  # the dead life's step 3 was aborted
        trainers[:] = [client(c, n) for n in range(2)]
        outs = run_all([lambda z=z, v=v: z.allreduce(torch.sparse_coo_tensor(
            torch.tensor([[1, 3]]), torch.full((2, 4), v), (ROWS, WIDTH)), name="emb")
            for z, v in zip(trainers, (10.0, 20.0), strict=True)])
        for out in outs:
            assert isinstance(out, torch.Tensor), out
            assert out.to_dense()[1].tolist() == [30.0] * WIDTH, out.to_dense()[1]
        assert [z.last_stats("emb").step for z in trainers] == [3, 3]  # type: ignore[union-attr]
        assert [z._tensors["emb"].next_step for z in trainers] == [4, 4]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for z in trainers:
            z.close()
