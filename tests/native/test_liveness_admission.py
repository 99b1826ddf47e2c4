"""Liveness (heartbeats keep an idle link up, the watchdog drops a silent peer), backpressure (a fast
sender is held back, the receiver's buffered bytes stay bounded), admission (the judge table of
zend/daemon/admission.py: refuse, discard, take) and the engine's events and stats."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest

from tests.native.support import DATA, MiB, down_reason, engines, link, native, pack_frame, raw_peer, wait_for

pytestmark = pytest.mark.inprocess


def test_the_watchdog_drops_a_peer_that_sends_nothing() -> None:
    with engines(1, peer_timeout_s=0.4, heartbeat_s=0.05) as (a,):
        silent = raw_peer(a, 2, sealed=True)  # a socket that never sends
        reason = down_reason(a, 2, timeout_s=5.0)
        assert re.fullmatch(r"rank 2 sent nothing for 0\.\d s \(peer timeout 0\.4 s\): frozen, overloaded or cut off",
                            reason), reason
        assert silent.closed_by_engine()


@pytest.mark.slow  # 2.5 s of idling: `make test` runs it, `make test-fast` does not
def test_heartbeats_keep_an_idle_link_up() -> None:
    with engines(2, peer_timeout_s=1.0, heartbeat_s=0.05) as (a, b):
        link(a, b, sealed=True)
        time.sleep(2.5)  # a few peer timeouts, nothing sent but heartbeats
        assert a.stats()["up_1"] == b.stats()["up_0"] == 1
        assert a.stats()["heartbeats_out"] > 5 and a.next_events(0.0) == []
        a.send(1, "t", b"alive")
        assert bytes(memoryview(b.recv(0, "t", 5.0))) == b"alive"
        assert a.stalled_since(time.monotonic() - 10) is None


def test_backpressure_bounds_what_the_receiver_holds_and_holds_the_sender() -> None:
    limit = 4 * MiB
    with engines(2, max_buffered_bytes=limit, peer_timeout_s=1.0, heartbeat_s=0.05) as (a, b):
        link(a, b, sealed=True)
        count = 100  # more than the sender may queue (64 MiB) plus what the sockets hold
        done = threading.Event()

        def sender() -> None:
            for i in range(count):
                a.send(1, "bulk", bytes([i % 256]) * MiB)
            done.set()

        th = threading.Thread(target=sender)
        th.start()
        wait_for(lambda: b.buffered(0) >= limit - MiB)
        for _ in range(25):  # held back for a few peer timeouts: never over the limit, never dropped
            assert b.buffered(0) <= limit
            time.sleep(0.1)
        assert not done.is_set() and b.stats()["up_0"] == 1
        for i in range(count):
            got = b.recv(0, "bulk", 10.0)
            assert len(got) == MiB and memoryview(got)[0] == i % 256
            assert b.buffered(0) <= limit
        th.join(10)
        assert done.is_set() and b.next_events(0.0) == []


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_admission_takes_discards_and_refuses_as_the_judge_says(sealed: bool) -> None:
    with engines(2, max_discarded_bytes=MiB) as (a, b):
        link(a, b, sealed)
        b.set_admission(True, 4, 1024)
        b.set_last_step("j", 1, 5)
        b.set_last_step("j", 2, -1)
        cases = [  # (tag, size, taken)
            ("j/9/0/0/agree/0", 10, True),  # an unknown tensor's first agreement, small
            ("j/9/0/0/agree/0", 2000, False),  # ... too big for one
            ("j/9/0/0/reduce/0", 10, False),  # ... another phase
            ("j/1/5/0/reduce/0", 10, False),  # a step already complete here
            ("j/1/6/0/reduce/0", 10, True),
            ("j/1/9/0/reduce/0", 10, True),  # last + window
            ("j/1/10/0/reduce/0", 10, False),  # past it
            ("j/2/123456/0/reduce/0", 10, True),  # a tensor's first step may be any
        ]
        for tag, size, _ in cases:
            a.send(1, tag, b"x" * size)
        a.send(1, "j/2/7/0/marker/0", b"m")
        assert bytes(memoryview(b.recv(0, "j/2/7/0/marker/0", 5.0))) == b"m"
        for tag, size, taken in cases:
            if taken:
                assert len(b.recv(0, tag, 1.0)) == size, tag
        assert b.buffered() == 0 and b.stats()["discarded"] == 4
        events = b.next_events(0.0)
        assert events == [("discarded", 0, 1, "tensor 9 of job key j is not registered on this node")]
        b.forget_tensor("j", 1)
        a.send(1, "j/1/6/1/reduce/0", b"forgotten tensor")
        a.send(1, "j/2/8/0/marker/0", b"m")
        assert bytes(memoryview(b.recv(0, "j/2/8/0/marker/0", 5.0))) == b"m"
        assert b.stats()["discarded"] == 5

        with contextlib.suppress(native.LinkDown):  # b may drop the link while a still writes the payload
            a.send(1, "j/1/6/2/reduce/0", bytes(MiB + 1))  # discarded, but too big to read only to drop
        assert down_reason(b, 0) == ("rank 0 sent a message this node refuses: tensor 1 of job key j is not "
                                     f"registered on this node, and its {MiB + 1} bytes are too many to read "
                                     "only to drop")
        link(a, b, sealed)
        a.send(1, "bad", b"")
        assert down_reason(b, 0) == ("rank 0 sent a message this node refuses: tag 'bad' is not a step's tag "
                                     "(job/tensor/step/attempt/phase/round)")
        link(a, b, sealed)
        a.abort("j/1/", "ABORTED", "a whole tensor")
        assert down_reason(b, 0) == ("rank 0 sent a message this node refuses: abort prefix 'j/1/' is not one "
                                     "step's attempt (job/tensor/step/attempt/)")


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_a_voided_steps_message_is_read_and_dropped_whatever_admission_says(sealed: bool) -> None:
    with engines(1) as (b,):
        b.set_admission(True, 4, 1024)
        b.set_last_step("j", 2, 0)
        peer = raw_peer(b, 2, sealed)
        b.abort("j/1/6/0/", "ABORTED", "failed step")
        peer.send(DATA, "j/1/6/0/reduce/1", b"late" * 100_000)  # an unknown tensor, but voided
        peer.send(DATA, "j/2/1/0/marker/0", b"m")
        assert bytes(memoryview(b.recv(2, "j/2/1/0/marker/0", 5.0))) == b"m"
        assert b.stats()["dropped"] == 1 and b.stats()["discarded"] == 0 and b.buffered() == 0


def test_a_closed_engine_refuses_calls_and_wakes_waiters() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        failed: list[BaseException] = []

        def waiter() -> None:
            try:
                a.recv(1, "never", 30.0)
            except native.EngineError as exc:
                failed.append(exc)

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.1)
        a.close()
        th.join(10)
        assert isinstance(failed[0], native.Closed)
        with pytest.raises(native.Closed):
            a.send(1, "t", b"")
        a.close()  # twice is fine


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_what_a_peer_sent_before_it_left_is_still_received_after_backpressure(sealed: bool) -> None:
    # no heartbeats to the peer: it closes with nothing unread, a hangup rather than a reset
    with engines(1, max_buffered_bytes=2 * MiB, heartbeat_s=30.0, peer_timeout_s=60.0) as (b,):
        peer = raw_peer(b, 2, sealed)
        count = 12

        def writer() -> None:
            for i in range(count):
                peer.send(DATA, "m", bytes([i]) * MiB)
            peer.sock.close()  # gone, with frames still unread on our side

        th = threading.Thread(target=writer)
        th.start()
        wait_for(lambda: b.buffered(2) == 2 * MiB)
        time.sleep(0.2)  # held back: the rest waits in the sockets
        for i in range(count):
            got = b.recv(2, "m", 10.0)
            assert len(got) == MiB and memoryview(got)[0] == i
        th.join(10)
        assert down_reason(b, 2) == "rank 2 disconnected: connection closed by peer"


@pytest.mark.slow  # 2.5 s of trickling: `make test` runs it, `make test-fast` does not
def test_a_payload_still_arriving_is_life() -> None:
    with engines(1, peer_timeout_s=1.0, heartbeat_s=0.05) as (a,):
        slow = raw_peer(a, 2, sealed=False)
        slow.send_raw(pack_frame("slow", 20))
        for _ in range(10):  # 2.5 s, a few peer timeouts, a byte at a time
            time.sleep(0.25)
            slow.send_raw(b"s")
        slow.send_raw(b"s" * 10)
        assert bytes(memoryview(a.recv(2, "slow", 5.0))) == b"s" * 20
        assert a.stats()["up_2"] == 1


def test_detach_drops_the_link_with_the_reason_given() -> None:
    with engines(2) as (a, b):
        serial, _ = link(a, b, sealed=True)
        a.detach(1, "dropped by the test")
        assert ("down", 1, serial, "rank 1 dropped by the test") in a.next_events(1.0)
        with pytest.raises(native.LinkDown, match="rank 0: rank 1 dropped by the test"):
            a.recv(1, "t", 5.0)
        assert down_reason(b, 0) == "rank 0 disconnected: connection closed by peer"
        stats = a.stats()
        assert stats["up_1"] == 0 and stats["connects_1"] == 1 and stats["links_dropped"] == 1


def test_discarded_messages_are_told_once_then_every_thousandth() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        b.set_admission(True, 1 << 20, 1024)
        for i in range(2000):
            a.send(1, f"j/{i}/0/0/reduce/0", b"junk")
        a.send(1, "j/0/0/0/agree/0", b"m")
        assert bytes(memoryview(b.recv(0, "j/0/0/0/agree/0", 10.0))) == b"m"
        counts = [count for what, _, count, _ in b.next_events(0.0) if what == "discarded"]
        assert counts == [1, 1000, 2000] and b.stats()["discarded"] == 2000 and b.buffered() == 0
