"""One conformance suite for every transport (the `scheme` fixture): real sockets, loopback."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from tests.transport.conftest import SECRET, connect_all, on_every_rank
from zend.core import CommError
from zend.transport import create, parse_uri
from zend.transport.framed import MAGIC
from zend.transport.handshake import HandshakeError


def test_messages_between_a_pair_arrive_in_order(mesh):
    a, b = mesh(2)
    for i in range(200):
        b.send(0, "t", torch.tensor([i], dtype=torch.int32).view(torch.uint8))
    got = [int(a.recv(1, "t").view(torch.int32)) for _ in range(200)]
    assert got == list(range(200))


@pytest.mark.parametrize("size", [0, 1, 4096, 64 << 20])
def test_sizes_from_empty_to_64_mib_arrive_intact(mesh, size):
    a, b = mesh(2)
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
    b.send(0, "big", payload)
    got = a.recv(1, "big")
    assert got.dtype == torch.uint8 and torch.equal(got, payload)


@pytest.mark.parametrize("n", [4, 8])
def test_concurrent_all_to_all(mesh, n):
    ts = mesh(n)

    def rank_body(t) -> None:  # type: ignore[no-untyped-def]
        for j in range(n):
            if j != t.rank:
                t.send(j, "a2a", torch.full((100_000 + t.rank,), t.rank * 10 + j, dtype=torch.uint8))
        for j in range(n):
            if j != t.rank:
                got = t.recv(j, "a2a")
                assert got.numel() == 100_000 + j and bool((got == j * 10 + t.rank).all())

    on_every_rank(ts, rank_body)


def test_tags_keep_messages_apart(mesh):
    a, b = mesh(2)
    b.send(0, "x", torch.tensor([1], dtype=torch.uint8))
    b.send(0, "y", torch.tensor([2], dtype=torch.uint8))
    assert int(a.recv(1, "y")) == 2 and int(a.recv(1, "x")) == 1


def _refusal(mesh, field: str, **override) -> str:  # type: ignore[no-untyped-def]
    good = mesh(2, connect=False)
    bad = mesh(2, connect=False, **override)
    peers = {0: good[0].address, 1: good[0].address}  # bad rank 1 dials good rank 0
    with pytest.raises((HandshakeError, CommError)) as info:
        bad[1].connect(peers, timeout_s=3)
    assert field in str(info.value), str(info.value)
    return str(info.value)


def test_wrong_secret_is_refused(mesh):
    _refusal(mesh, "authentication failed", secret=b"another-secret-0123456789")


def test_version_mismatch_is_refused_naming_the_field(mesh):
    _refusal(mesh, "protocol version 2 != 1", protocol_version=2)


def test_cluster_and_generation_mismatch_are_refused(mesh):
    _refusal(mesh, "cluster id 'other' != 'test'", cluster_id="other")
    _refusal(mesh, "membership generation 7 != 0", generation=7)


def test_garbage_on_the_socket_is_refused_and_others_are_served(mesh):
    a, b = mesh(2)
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", b"\xff\xff\xff\x7f" + b"x" * 100):
        with socket.create_connection(a.address, timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            reply = b""
            with contextlib.suppress(OSError):
                reply = s.recv(100)  # refused: an error message or a closed connection
            assert MAGIC not in reply and b"challenge" not in reply
    b.send(0, "after", torch.tensor([7], dtype=torch.uint8))
    assert int(a.recv(1, "after")) == 7


def test_recv_times_out_naming_the_peer(mesh):
    a, _ = mesh(2)
    start = time.monotonic()
    with pytest.raises(CommError, match=r"no message from rank 1 \(tag 'never'\) within 0.5 s"):
        a.recv(1, "never", timeout_s=0.5)
    assert time.monotonic() - start < 3


def test_closed_peer_fails_pending_recv_at_once(mesh):
    a, b = mesh(2)
    threading.Timer(0.3, b.close).start()
    start = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1 .*disconnected"):
        a.recv(1, "pending", timeout_s=30)
    assert time.monotonic() - start < 5


def test_backpressure_bounds_unclaimed_bytes(mesh):
    a, b = mesh(2, max_buffered_bytes=4 << 20)
    sender_done = threading.Event()

    def flood() -> None:
        for i in range(16):
            b.send(0, f"m{i}", torch.zeros(1 << 20, dtype=torch.uint8))
        sender_done.set()

    threading.Thread(target=flood, daemon=True).start()
    time.sleep(1.0)
    assert a.peers[1].buffered <= (4 << 20) + (1 << 20)  # the limit plus one message in flight
    for i in range(16):
        assert a.recv(1, f"m{i}").numel() == 1 << 20
    assert sender_done.wait(10)


def test_peer_killed_mid_transfer_fails_in_bounded_time(workers):
    me = create(f"{workers.scheme}://127.0.0.1:0", 0, 2, cluster_id="test", secret=SECRET, timeout_s=30)
    try:
        proc, port = workers.start(1, 2, "flood")
        workers.send_peers(proc, {0: me.address, 1: ("127.0.0.1", port)})
        me.connect({0: me.address, 1: ("127.0.0.1", port)})
        assert me.recv(1, "flood/0").numel() == 64 << 20  # it is streaming
        time.sleep(0.05)
        proc.kill()  # mid-way through a 64 MiB message
        start = time.monotonic()
        with pytest.raises(CommError, match=r"rank 1 at 127\.0\.0\.1"):
            for step in range(1, 10_000):
                me.recv(1, f"flood/{step}", timeout_s=30)
        assert time.monotonic() - start < 5
    finally:
        me.close()


def test_restarted_peer_reconnects(workers):
    me = create(f"{workers.scheme}://127.0.0.1:0", 1, 2, cluster_id="test", secret=SECRET, timeout_s=20)
    try:
        proc, port = workers.start(0, 2, "pong")  # rank 0 accepts; we (rank 1) dial it
        peers = {0: ("127.0.0.1", port), 1: me.address}
        workers.send_peers(proc, peers)
        me.connect(peers)
        ping = torch.arange(100, dtype=torch.uint8)
        me.send(0, "ping/0", ping)
        assert torch.equal(me.recv(0, "pong/0"), ping)
        proc.kill()
        proc.wait(10)
        with pytest.raises(CommError, match=r"rank 0 at 127\.0\.0\.1"):
            me.recv(0, "pong/1", timeout_s=5)
        proc2, port2 = workers.start(0, 2, "pong")
        me.peers[0].address = ("127.0.0.1", port2)  # the restarted node got a new port
        workers.send_peers(proc2, {0: ("127.0.0.1", port2), 1: me.address})
        me.wait_connected(0, timeout_s=15)  # redialled in the background
        me.send(0, "ping/0", ping)  # the new process starts counting from 0
        assert torch.equal(me.recv(0, "pong/0"), ping)
    finally:
        me.close()


def test_uri_parsing_names_bad_input():
    assert parse_uri("tcp://198.18.0.2:7000") == ("tcp", "198.18.0.2", 7000)
    with pytest.raises(ValueError, match="scheme 'http'"):
        parse_uri("http://x:1")
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        parse_uri("tcp://hostonly")


def test_all_ranks_connect_in_any_start_order(mesh):
    ts = mesh(5, connect=False)
    connect_all(list(reversed(ts)))
    for t in ts:
        assert all(p.link is not None for p in t.peers.values())


def test_auto_transport_choice_and_reason():
    from zend.transport import choose_transport

    assert choose_transport("auto", ["a", "b"], ucx_transports=set())[0] == "tcp"
    assert choose_transport("auto", ["a", "b"], ucx_transports={"tcp", "posix"}) == (
        "tcp", "plain TCP network: our sockets beat ucxx over TCP")
    assert choose_transport("auto", ["a", "a"], ucx_transports={"tcp", "posix"})[0] == "ucx"
    assert choose_transport("auto", ["a", "b"], ucx_transports={"tcp", "rc_mlx5"})[0] == "ucx"
    assert choose_transport("auto", ["a", "b"], gpu_tensors=True, ucx_transports={"tcp", "cuda_copy"})[0] == "ucx"
    assert choose_transport("tcp", ["a"]) == ("tcp", "set to tcp")
    with pytest.raises(ValueError, match="'rdma' is not"):
        choose_transport("rdma", ["a"])
