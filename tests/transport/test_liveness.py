"""Liveness and aborts on real rank processes (tcp:// and ucx://): heartbeats keep an idle link up
and tell a frozen peer (SIGSTOP) from a slow one within the peer timeout; an abort voids a step's
messages on both sides, buffered or late."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers import poll_for
from tests.transport.conftest import RemoteError

pytestmark = pytest.mark.daemon

PEER_TIMEOUT_S = 1.0


def test_an_idle_link_stays_up_for_three_peer_timeouts(processes):
    a, b = processes.mesh(2, timeout_s=PEER_TIMEOUT_S)
    before = a.call("links")["connects"], b.call("links")["connects"]
    time.sleep(3.5 * PEER_TIMEOUT_S)  # the point: idle for three peer timeouts and more
    after = a.call("links"), b.call("links")
    assert (after[0]["connects"], after[1]["connects"]) == before == ({"1": 1}, {"0": 1})  # no drop, no redial
    assert after[0]["up"] == {"1": True} and after[1]["up"] == {"0": True}
    b.call("send", dst=0, tag="still", seeds=[3], size=100)
    assert a.call("recv", src=1, tag="still", seeds=[3], size=100)["intact"] == [True]


def test_a_slow_but_alive_peer_is_waited_for_past_the_peer_timeout(processes):
    a, b = processes.mesh(2, timeout_s=PEER_TIMEOUT_S)
    pending = a.start("recv", src=1, tag="late", seeds=[5], size=1000, timeout_s=30)  # the step timeout
    time.sleep(3 * PEER_TIMEOUT_S)  # the point: the peer is late by three peer timeouts
    b.call("send", dst=0, tag="late", seeds=[5], size=1000)
    assert a.wait(pending)["intact"] == [True]
    assert a.call("links")["connects"] == {"1": 1}


def test_a_frozen_peer_is_lost_within_the_peer_timeout_and_rejoins_after_it_thaws(processes):
    a, b = processes.mesh(2, timeout_s=PEER_TIMEOUT_S)  # rank 1 dials rank 0, and redials it
    pending = a.start("recv", src=1, tag="never", seeds=[0], size=1, timeout_s=60)
    time.sleep(0.2)  # kept: the receive is under way (the worker does not say when a receive starts waiting)
    os.kill(b.proc.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        with pytest.raises(RemoteError, match=r"rank 1 .*sent nothing for"):
            a.wait(pending, timeout_s=30)
        detected = time.monotonic() - frozen
        assert detected < PEER_TIMEOUT_S + 1.0, f"lost after {detected:.2f} s"
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    # thawed, it finds its link gone and dials again
    poll_for(lambda: a.call("links")["connects"]["1"] >= 2, 20, "the thawed peer back", interval_s=0.1)
    b.call("send", dst=0, tag="back", seeds=[9], size=10)
    assert a.call("recv", src=1, tag="back", seeds=[9], size=10, timeout_s=10)["intact"] == [True]


def test_an_abort_voids_a_prefix_on_both_sides_buffered_and_late(processes):
    a, b = processes.mesh(2, timeout_s=5.0)
    b.call("send", dst=0, tag="job/1/7/0/push/0", seeds=[1, 2, 3], size=4096)
    b.call("send", dst=0, tag="job/1/8/0/push/0", seeds=[4], size=4096)  # another step: kept
    poll_for(lambda: a.call("mailbox")["bytes"] >= 4 * 4096, 10, "the four messages in rank 0's mailbox")
    waiting = b.start("recv", src=0, tag="job/1/7/0/pull/0", seeds=[0], size=1, timeout_s=30)
    a.call("abort", prefix="job/1/7/0/", reason="node 0: trainer local rank 1 left")
    box = a.call("mailbox")
    assert (box["bytes"], box["dropped"]) == (4096, 3)  # only the other step's message is left
    with pytest.raises(RemoteError, match="trainer local rank 1 left") as info:
        b.wait(waiting, timeout_s=10)  # the notice reached the peer: its receive ends at once
    assert info.value.kind == "CommAborted"
    with pytest.raises(RemoteError, match="trainer local rank 1 left"):
        b.call("send", dst=0, tag="job/1/7/0/pull/1", seeds=[0], size=1)  # and it sends nothing more of it
    with pytest.raises(RemoteError, match="trainer local rank 1 left"):
        a.call("recv", src=1, tag="job/1/7/0/push/0", seeds=[1], size=4096)
    assert a.call("recv", src=1, tag="job/1/8/0/push/0", seeds=[4], size=4096)["intact"] == [True]
    assert a.call("mailbox")["bytes"] == 0
