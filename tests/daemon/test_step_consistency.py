"""Every node the same outcome, with real daemons (one process per node, tcp:// on loopback) and
real faults: a straggler, a frozen daemon (SIGSTOP / SIGCONT), a trainer killed mid-step."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import poll_for, random_grad, run_all, status_code, steps_in_flight
from tests.subprocess_env import with_project
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed

pytestmark = pytest.mark.daemon

PEER_TIMEOUT_S = 2.0
EXTRA = ["--peer-timeout-s", str(PEER_TIMEOUT_S), "--step-timeout-s", "60", "--log-format", "text"]


def _same(results: list) -> None:  # type: ignore[type-arg]
    first = results[0].to_dense()
    for r in results[1:]:
        assert torch.equal(r.to_dense(), first)


def test_a_straggler_twice_the_peer_timeout_late_is_waited_for_and_every_node_gets_the_same_bits(fresh_cluster):
    c = fresh_cluster(3, extra=EXTRA)

    def body(node: int):  # type: ignore[no-untyped-def]
        with TrainerSession(c.socket_dir(node), "j", c.token("j"), 0, 1, timeout_s=60) as link:
            h = link.register("emb", (200, 4))
            if node == 2:
                time.sleep(2 * PEER_TIMEOUT_S)  # the point: a GC pause, a slow data loader: alive, just late
            return [link.allreduce(h, random_grad(200, 4, 10 * step + node), step) for step in range(2)]

    results = run_all([lambda n=n: body(n) for n in range(3)])
    for step in range(2):
        _same([r[step] for r in results])
        expected = sum(random_grad(200, 4, 10 * step + n).to_dense() for n in range(3))
        torch.testing.assert_close(results[0][step].to_dense(), expected)


def test_a_frozen_daemon_aborts_the_step_everywhere_and_after_it_thaws_the_retry_succeeds(fresh_cluster):
    c = fresh_cluster(3, extra=EXTRA)
    links = [TrainerSession(c.socket_dir(n), "j", c.token("j"), 0, 1, timeout_s=60) for n in range(3)]
    try:
        handles = [link.register("emb", (100, 4)) for link in links]
        frozen: dict[str, float] = {}

        def survivor(node: int):  # type: ignore[no-untyped-def]
            return links[node].allreduce(handles[node], random_grad(100, 4, node), 0)

        def freeze():  # type: ignore[no-untyped-def]
            poll_for(lambda: steps_in_flight(c, 0) and steps_in_flight(c, 1), 20,
                     "nodes 0 and 1 in the step, waiting for node 2")
            c.send_signal(2, signal.SIGSTOP)
            frozen["at"] = time.monotonic()

        results = run_all([lambda: survivor(0), lambda: survivor(1), freeze])
        detected = time.monotonic() - frozen["at"]
        for r in results[:2]:
            assert status_code(r) == "ABORTED" and "rank 2" in r.message, r
        assert detected < PEER_TIMEOUT_S + 1.0, f"aborted {detected:.2f} s after the freeze"
        c.send_signal(2, signal.SIGCONT)
        # the thawed node never delivers step 0 either: it learns of the abort when it reconnects
        try:
            thawed = links[2].allreduce(handles[2], random_grad(100, 4, 2), 0)
        except StepFailed as exc:
            thawed = exc
        assert status_code(thawed) == "ABORTED", thawed
        # every trainer submits step 0 again, once the links are back: the same sum everywhere
        def retry(node: int):  # type: ignore[no-untyped-def]
            def attempt():  # type: ignore[no-untyped-def]
                try:
                    return [links[node].allreduce(handles[node], random_grad(100, 4, node), 0)]
                except StepFailed as exc:
                    if status_code(exc) != "ABORTED":
                        raise
                    return None

            return poll_for(attempt, 30, f"node {node}'s step 0 redone", interval_s=0.2)[0]

        again = run_all([lambda n=n: retry(n) for n in range(3)])
        _same(again)
        torch.testing.assert_close(again[0].to_dense(), sum(random_grad(100, 4, n).to_dense() for n in range(3)))
    finally:
        c.send_signal(2, signal.SIGCONT)  # never leave it frozen (a no-op once it runs)
        for link in links:
            link.close()


def test_a_trainer_killed_mid_step_aborts_it_for_every_trainer_on_every_node_then_the_job_goes_on(fresh_cluster):
    c = fresh_cluster(2, extra=EXTRA)
    script = (
        "import time\n"
        "from zend.protocol.session import TrainerSession\n"
        f"link = TrainerSession({c.socket_dir(0)!r}, 'j', {c.token('j')!r}, 1, 2)\n"
        "link.register('emb', (300, 8))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")
    victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=with_project())
    links = {(n, r): TrainerSession(c.socket_dir(n), "j", c.token("j"), r, 2, timeout_s=60)
             for n, r in [(0, 0), (1, 0), (1, 1)]}
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        handles = {k: link.register("emb", (300, 8)) for k, link in links.items()}
        killed: dict[str, float] = {}

        def submit(key):  # type: ignore[no-untyped-def]
            return links[key].allreduce(handles[key], random_grad(300, 8, 2 * key[0] + key[1]), 4)

        def kill():  # type: ignore[no-untyped-def]
            poll_for(lambda: steps_in_flight(c, 0) and steps_in_flight(c, 1), 20,
                     "step 4 open on both nodes, node 0's waiting for the victim")
            victim.kill()
            killed["at"] = time.monotonic()

        results = run_all([*(lambda k=k: submit(k) for k in links), kill])
        took = time.monotonic() - killed["at"]
        for r in results[:3]:
            assert status_code(r) == "ABORTED", r
            assert "local rank 1" in r.message and "node 0" in r.message and "step 4" in r.message, r
        assert took < PEER_TIMEOUT_S + 1.0, f"aborted {took:.2f} s after the kill"
        # the trainer restarts (a new session, the same local rank) and the job redoes step 4
        links[(0, 1)] = TrainerSession(c.socket_dir(0), "j", c.token("j"), 1, 2, timeout_s=60)
        handles[(0, 1)] = links[(0, 1)].register("emb", (300, 8))
        again = run_all([lambda k=k: submit(k) for k in links])
        _same(again)
        expected = sum(random_grad(300, 8, 2 * n + r).to_dense() for n in range(2) for r in range(2))
        torch.testing.assert_close(again[0].to_dense(), expected)
    finally:
        victim.kill()
        victim.wait()
        for link in links.values():
            link.close()
