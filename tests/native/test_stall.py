"""Our own stall: the whole process stopped (SIGSTOP, then SIGCONT from a helper process) for longer than
half the peer timeout. The I/O loop sees the gap, judges nobody for it (the silence was ours), records it
for stalled_since and says so in a "stall" event."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.native.support import engines, link

pytestmark = pytest.mark.daemon  # it starts a helper process


def test_a_stall_of_our_own_is_seen_and_forgiven() -> None:
    with engines(2, peer_timeout_s=1.0, heartbeat_s=0.05) as (a, b):
        link(a, b, sealed=True)
        before = time.monotonic()
        assert a.stalled_since(before) is None
        waker = subprocess.Popen(["sh", "-c", f"sleep 1.5; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stands still, the I/O threads too
        waker.wait(10)
        time.sleep(0.2)
        stalled = a.stalled_since(before)
        assert stalled is not None and stalled > 0.5
        events = a.next_events(1.0)
        assert any(what == "stall" and float(detail) > 0.5 for what, _, _, detail in events), events
        assert not any(what == "down" for what, *_ in events), events  # nobody judged for our silence
        assert a.stats()["stalls"] >= 1 and a.stats()["up_1"] == 1
        a.send(1, "t", b"after")
        assert bytes(memoryview(b.recv(0, "t", 5.0))) == b"after"
