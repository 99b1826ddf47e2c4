"""A daemon killed (kill -9) and restarted with the same rank rejoins its cluster (--elastic 1):
the members form a new generation on torch's elastic rendezvous, the surviving trainers wait
(`zen.Client.wait_ready`) and redo the step, the restarted node's trainers open new sessions,
and every later sum is correct on every node."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zen

from tests.helpers import node_status, random_grad, run_all

pytestmark = pytest.mark.daemon

PEER_TIMEOUT_S = 2.0
EXTRA = ["--peer-timeout-s", str(PEER_TIMEOUT_S), "--step-timeout-s", "30", "--log-format", "text",
         "--connect-timeout-s", "60"]
ROWS, WIDTH, STEPS, KILL_AT = 300, 4, 6, 3


def expected(step: int, nodes: int) -> torch.Tensor:
    return sum(random_grad(ROWS, WIDTH, 100 * step + n).to_dense() for n in range(nodes))  # type: ignore[return-value]


def test_a_daemon_killed_and_restarted_rejoins_and_the_job_goes_on_with_correct_sums(fresh_cluster):
    c = fresh_cluster(3, elastic=True, extra=EXTRA)
    go, killed, restarted = threading.Event(), threading.Event(), {}
    at_kill_step = threading.Barrier(3 + 1)

    def trainer(node: int) -> dict:  # type: ignore[type-arg]
        zc = zen.Client(c.socket_dir(node), job="j", token=c.token("j"), local_rank=0, local_world_size=1,
                        timeout_s=60)
        first_generation, sums, faults, good_after_kill, resumed = zc.generation, {}, [], None, []
        try:
            step = 0
            while step < STEPS:
                if step == KILL_AT and not go.is_set():
                    at_kill_step.wait(60)  # every trainer has finished the steps before
                    go.wait(60)  # node 1's daemon is dead now
                g = random_grad(ROWS, WIDTH, 100 * step + node)
                try:
                    out = zc.allreduce(g.to_torch_sparse(), name="emb", step=step)
                except (zen.StepAborted, zen.DaemonUnavailable) as exc:
                    faults.append((step, type(exc).__name__, str(exc)))
                    assert len(faults) <= 4, faults  # a retry that fails for good
                    zc.wait_ready(90)
                    resumed.append(zc.job_step)  # where the daemon says the job is
                    continue  # the same step again, from the same state
                sums[step] = out.to_dense()
                if step == KILL_AT:
                    good_after_kill = time.monotonic()
                step += 1
            return {"sums": sums, "faults": faults, "generations": (first_generation, zc.generation),
                    "good_after_kill": good_after_kill, "resumed": resumed}
        finally:
            zc.close()

    def killer() -> None:
        at_kill_step.wait(60)
        c.kill(1)
        restarted["killed_at"] = time.monotonic()
        killed.set()
        go.set()
        c.start_node(1)
        c.wait_ready(1, 90)
        restarted["ready_at"] = time.monotonic()

    results = run_all([lambda n=n: trainer(n) for n in range(3)] + [killer], timeout_s=180)
    for r in results[:3]:
        assert isinstance(r, dict), r
    for step in range(STEPS):
        want = expected(step, 3)
        for node, r in enumerate(results[:3]):
            torch.testing.assert_close(r["sums"][step], want, msg=f"node {node} step {step}")
    for node, r in enumerate(results[:3]):
        first, last = r["generations"]
        assert last > first, f"node {node}: generation {first} -> {last}"
        assert r["faults"] and all(f[0] == KILL_AT for f in r["faults"]), r["faults"]
        assert r["resumed"][-1] == KILL_AT, f"node {node}: told the job is at {r['resumed']}, not {KILL_AT}"
    statuses = [node_status(c, n) for n in range(3)]
    assert len({s.generation for s in statuses}) == 1, [s.generation for s in statuses]
    for node in (0, 2):  # the survivors formed a new generation because node 1 came back
        assert "waiting to join" in statuses[node].last_membership_change, statuses[node]
    took = max(r["good_after_kill"] for r in results[:3]) - restarted["killed_at"]
    print(f"kill -9 -> next good step on every node: {took:.2f} s")
    assert took < 60


def redo_until_done(zc: zen.Client, node: int, step: int) -> tuple[torch.Tensor, int]:
    """The step's sum (and how many tries it took), redone after each abort as a training loop does."""
    for tries in range(1, 6):
        try:
            g = random_grad(ROWS, WIDTH, 100 * step + node)
            return zc.allreduce(g.to_torch_sparse(), name="emb", step=step).to_dense(), tries
        except (zen.StepAborted, zen.DaemonUnavailable):
            zc.wait_ready(60)
    raise AssertionError(f"node {node}: step {step} never succeeded")


def test_with_min_nodes_the_survivors_go_on_with_the_sum_of_the_rest_and_take_the_node_back(fresh_cluster):
    c = fresh_cluster(3, elastic=True, extra=[*EXTRA, "--min-nodes", "2"])
    clients = {n: zen.Client(c.socket_dir(n), job="j", token=c.token("j"), local_rank=0, local_world_size=1,
                             timeout_s=60) for n in range(3)}
    try:
        first = run_all([lambda n=n: redo_until_done(clients[n], n, 0) for n in range(3)])
        for out, _ in first:
            torch.testing.assert_close(out, expected(0, 3))
        generation = clients[0].generation
        c.kill(2)  # for good: nobody restarts it (yet)
        clients.pop(2).close()
        smaller = run_all([lambda n=n: redo_until_done(clients[n], n, 1) for n in range(2)])
        want = sum(random_grad(ROWS, WIDTH, 100 + n).to_dense() for n in range(2))
        for n, (out, tries) in enumerate(smaller):
            torch.testing.assert_close(out, want, msg=f"node {n}: the sum of the two nodes left")
            assert tries > 1, "the step did not abort when node 2 was lost"
            assert clients[n].world_size == 2 and clients[n].generation > generation
        assert node_status(c, 0).node_count == 2
        c.start_node(2)  # it comes back: a generation of three again
        c.wait_ready(2, 60)
        clients[2] = zen.Client(c.socket_dir(2), job="j", token=c.token("j"), local_rank=0, local_world_size=1,
                                timeout_s=60)
        whole = run_all([lambda n=n: redo_until_done(clients[n], n, 2) for n in range(3)])
        for n, (out, _) in enumerate(whole):
            torch.testing.assert_close(out, expected(2, 3), msg=f"node {n}")
        assert {clients[n].world_size for n in range(3)} == {3}
        assert {node_status(c, n).node_count for n in range(3)} == {3}
    finally:
        for zc in clients.values():
            zc.close()


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
