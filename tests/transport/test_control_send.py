"""A control frame (heartbeat, goodbye) on tcp:// goes whole or drops the link within its limit: the one
heartbeat thread serves every link, so a peer that stops reading half-way through a frame must not hold it."""

from __future__ import annotations

import time

import pytest

from zend.transport.tcp import send_within

pytestmark = pytest.mark.inprocess


class Link:
    """A socket's send as a peer that reads in bursts: `room` bytes it takes now, then none until polled."""

    def __init__(self, bursts: list[int]):
        self.bursts, self.room, self.got = bursts, bursts.pop(0), bytearray()

    def send(self, data: memoryview, flags: int) -> int:
        if self.room == 0:
            raise BlockingIOError
        n = min(self.room, len(data))
        self.got += bytes(data[:n])
        self.room -= n
        return n


class Poller:
    """poll(): room again as long as the link has bursts left; else nothing, after the wait asked for."""

    def __init__(self, link: Link):
        self.link, self.waited = link, 0.0

    def poll(self, timeout_ms: int) -> list[tuple[int, int]]:
        if self.link.bursts:
            self.link.room = self.link.bursts.pop(0)
            return [(0, 4)]
        time.sleep(timeout_ms / 1000)
        self.waited += timeout_ms / 1000
        return []


def test_a_frame_taken_in_pieces_goes_whole_and_in_order() -> None:
    frame = bytes(range(60))
    link = Link([7, 0, 20, 1, 100])
    send_within(link, Poller(link), frame, 1.0)
    assert bytes(link.got) == frame


def test_a_peer_that_stops_reading_half_way_drops_the_link_within_the_limit_not_never() -> None:
    link = Link([7])
    poller = Poller(link)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=r"within 0.3 s \(7 of 60 bytes\)"):
        send_within(link, poller, bytes(60), 0.3)
    assert time.monotonic() - started < 5.0 and poller.waited > 0  # it waited for room, and then gave up
