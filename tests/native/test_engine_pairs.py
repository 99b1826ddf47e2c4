"""The native engine against itself: clear and sealed links over socketpairs and loopback TCP, message
sizes around the sealed record size, interleaved tags, exchange, aborts, timeouts, lost links, goodbye."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.native.support import MiB, engines, link, native, wait_for

pytestmark = pytest.mark.inprocess

SIZES = [0, 1, MiB - 1, MiB, 2 * MiB + 7, 64 * MiB]


@pytest.mark.parametrize("tcp", [False, True], ids=["socketpair", "tcp"])
@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_every_size_arrives_whole_both_ways(sealed: bool, tcp: bool) -> None:
    with engines(2) as (a, b):
        assert link(a, b, sealed, tcp) == (1, 1)
        for size in SIZES:
            data = os.urandom(size)
            a.send(1, f"s/{size}", data)
            b.send(0, f"s/{size}", data[::-1])
            got, back = b.recv(0, f"s/{size}", 30.0), a.recv(1, f"s/{size}", 30.0)
            assert len(got) == size and bytes(memoryview(got)) == data
            assert bytes(memoryview(back)) == data[::-1]
            assert memoryview(got).format == "B" and memoryview(got).readonly == (size == 0)  # writable: its own
        assert a.buffered() == b.buffered() == 0


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_many_tags_interleaved_from_threads_keep_their_order(sealed: bool) -> None:
    with engines(2) as (a, b):
        link(a, b, sealed)
        tags, per_tag = 16, 50

        def sender(t: int) -> None:
            for i in range(per_tag):
                a.send(1, f"tag/{t}", i.to_bytes(4, "little") * (1 + (i * 37 + t) % 3000))

        threads = [threading.Thread(target=sender, args=(t,)) for t in range(tags)]
        for th in threads:
            th.start()
        for t in reversed(range(tags)):  # taken in another order than sent
            for i in range(per_tag):
                got = bytes(memoryview(b.recv(0, f"tag/{t}", 30.0)))
                assert got == i.to_bytes(4, "little") * (1 + (i * 37 + t) % 3000)
        for th in threads:
            th.join()
        assert b.stats()["frames_in"] >= tags * per_tag


def test_a_sender_may_reuse_its_buffer_at_once() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        buf = bytearray(b"x" * 1000)
        a.send(1, "t", buf)
        buf[:] = b"y" * 1000
        a.send(1, "t", buf)
        assert bytes(memoryview(b.recv(0, "t", 10.0))) == b"x" * 1000
        assert bytes(memoryview(b.recv(0, "t", 10.0))) == b"y" * 1000


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_exchange_is_one_round_in_one_call(sealed: bool) -> None:
    with engines(3) as (a, b, c):
        link(a, b, sealed)
        link(a, c, sealed)
        link(b, c, sealed)
        results: dict[int, list[bytes]] = {}

        def round_of(e: native.Engine) -> None:
            others = [j for j in range(3) if j != e.rank]
            got = e.exchange([(j, "r/0", bytes([e.rank]) * (j + 1)) for j in others], [(j, "r/0") for j in others],
                             10.0)
            results[e.rank] = [bytes(memoryview(m)) for m in got]

        threads = [threading.Thread(target=round_of, args=(e,)) for e in (a, b, c)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert results == {0: [b"\x01", b"\x02"], 1: [b"\x00\x00", b"\x02\x02"], 2: [b"\x00\x00\x00", b"\x01\x01\x01"]}


def test_exchange_raises_the_first_failing_receive() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        b.send(0, "there", b"1")
        with pytest.raises(native.Timeout, match="tag 'missing'"):
            a.exchange([(1, "x", b"")], [(1, "there"), (1, "missing")], 0.3)
        assert bytes(memoryview(b.recv(0, "x", 5.0))) == b""


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
def test_abort_voids_both_sides_and_is_replayed_on_a_new_link(sealed: bool) -> None:
    with engines(2) as (a, b):
        link(a, b, sealed)
        a.send(1, "job/1/5/0/reduce/0", b"early")  # in b's mailbox before the abort
        wait_for(lambda: b.buffered(0) == 5)
        waiting: list[BaseException] = []

        def receiver() -> None:
            try:
                b.recv(0, "job/1/5/0/reduce/1", 10.0)
            except native.EngineError as exc:
                waiting.append(exc)

        th = threading.Thread(target=receiver)
        th.start()
        assert a.abort("job/1/5/0/", "PEER_FAILED", "rank 0 lost its tensor")
        assert not a.abort("job/1/5/0/", "PEER_FAILED", "again")  # already voided
        th.join(10)
        assert isinstance(waiting[0], native.Aborted)
        assert (waiting[0].code, waiting[0].reason) == ("PEER_FAILED", "rank 0 lost its tensor")
        assert b.voided("job/1/5/0/reduce/0") == ("PEER_FAILED", "rank 0 lost its tensor")
        assert b.buffered() == 0 and b.stats()["dropped"] == 1
        with pytest.raises(native.Aborted):
            b.send(0, "job/1/5/0/x/0", b"")
        a.send(1, "job/1/6/0/reduce/0", b"next step")  # other steps go on
        assert bytes(memoryview(b.recv(0, "job/1/6/0/reduce/0", 5.0))) == b"next step"

    with engines(2) as (a, b):  # a fresh b learns of the abort when a's link to it (re)attaches
        a.abort("job/2/1/0/", "ABORTED", "before you came")
        link(a, b, sealed)
        wait_for(lambda: b.voided("job/2/1/0/x/0") == ("ABORTED", "before you came"))


def test_abort_notice_keeps_any_reason_text() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        reason = 'quote " back \\ slash / tab \t nl \n \x01 é 中 😀'
        a.abort("j/1/1/0/", "SOME_CODE", reason)
        assert wait_for(lambda: b.voided("j/1/1/0/")) == ("SOME_CODE", reason)


def test_timeout_names_the_peer_tag_and_link_state() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=True)
        with pytest.raises(native.Timeout) as caught:
            a.recv(1, "job/1/1/0/x/0", 0.2)
        assert str(caught.value) == "rank 0: no message from rank 1 (tag 'job/1/1/0/x/0') within 0.2 s (connected)"
        with pytest.raises(native.Timeout, match=r"rank 2 not connected yet"):
            a.recv(2, "t", 0.1)  # never connected: waits, it may still come


def test_goodbye_on_close_fails_the_peers_receives_at_once() -> None:
    with engines(2) as (a, b):
        serials = link(a, b, sealed=True)
        failed: list[BaseException] = []

        def receiver() -> None:
            try:
                b.recv(0, "t", 30.0)
            except native.EngineError as exc:
                failed.append(exc)

        th = threading.Thread(target=receiver)
        th.start()
        a.close()
        th.join(10)
        assert isinstance(failed[0], native.LinkDown)
        assert str(failed[0]) == "rank 1: rank 0 disconnected: closed by the peer"
        assert ("down", 0, serials[1], "rank 0 disconnected: closed by the peer") in b.next_events(1.0)
        with pytest.raises(native.LinkDown, match="cannot send to rank 0 disconnected"):
            b.send(0, "t", b"")
        with pytest.raises(native.Closed):
            a.recv(1, "t", 1.0)


def test_a_replaced_link_fails_receives_waiting_on_the_old_one() -> None:
    with engines(2) as (a, b):
        link(a, b, sealed=False)
        failed: list[BaseException] = []

        def receiver() -> None:
            try:
                b.recv(0, "t", 30.0)
            except native.EngineError as exc:
                failed.append(exc)

        th = threading.Thread(target=receiver)
        th.start()
        time.sleep(0.1)  # the receiver waits on the first link
        assert link(a, b, sealed=True) == (2, 2)
        th.join(10)
        assert isinstance(failed[0], native.LinkDown) and "rank 0" in str(failed[0])
        a.send(1, "t", b"on the new link")
        assert bytes(memoryview(b.recv(0, "t", 5.0))) == b"on the new link"


def test_send_without_a_link_and_bad_arguments() -> None:
    with engines(2) as (a, _b):
        with pytest.raises(native.LinkDown, match="rank 0: cannot send to rank 1 not connected yet"):
            a.send(1, "t", b"")
        with pytest.raises(ValueError, match="invalid peer"):
            a.send(0, "t", b"")
        with pytest.raises(ValueError, match="exceeds 236"):
            a.send(1, "x" * 237, b"")
        with pytest.raises(ValueError, match="32 bytes"):
            a.attach(1, 0, b"short", b"short")
        with pytest.raises(ValueError):
            native.Engine(3, 3, max_buffered_bytes=1, max_message_bytes=1, peer_timeout_s=1.0, heartbeat_s=0.1)
