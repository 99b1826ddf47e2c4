"""The data plane's accept path under abuse (issue 14, item 1): one source cannot take every
handshake slot, and the listener outlives a spell without file descriptors, saying so meanwhile."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time

import pytest

from tests.helpers import poll_for

pytestmark = pytest.mark.daemon


def _from(source: str, address: tuple[str, int]) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect(address)
    return s


def test_one_source_cannot_take_every_handshake_slot(processes, scheme):
    if not scheme.startswith("tcp"):
        pytest.skip("raw tcp clients from a chosen source address")
    good = processes.start(0, 2, timeout_s=10)  # a silent client is held for 10 s
    idle = []
    try:
        for _ in range(100):  # beyond every bound, all from one address
            with contextlib.suppress(OSError):
                idle.append(_from("127.0.0.2", good.address))
        time.sleep(0.5)  # kept: the listener takes the flood in (it does not say how many handshakes it holds)
        took = processes.let_in(good, seed=8, timeout_s=10)
        # without the per-source bound the 100 would hold all 64 slots for the 10 s handshake deadline
        assert took < 6, "the peer waited for the flood's handshakes to time out"
    finally:
        for s in idle:
            s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering another process's descriptor limit needs root")
def test_the_listener_outlives_running_out_of_descriptors_and_says_so(processes, scheme):
    if not scheme.startswith("tcp"):
        pytest.skip("ucx:// accepts inside UCX, which keeps its own descriptors")
    good = processes.start(0, 2, timeout_s=10)
    pid = good.proc.pid
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (len(os.listdir(f"/proc/{pid}/fd")) + 1, limits[1]))
        for _ in range(4):  # the first takes the last descriptor; accepting the next fails
            held.append(socket.create_connection(good.address, timeout=5))
        error = poll_for(lambda: good.call("accepting")["accept_error"], 10, "an accept error", interval_s=0.1)
        assert "Too many open files" in error, error
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)
        for s in held:
            s.close()
    processes.let_in(good, seed=9, timeout_s=10)
    assert good.call("accepting")["accept_error"] is None
