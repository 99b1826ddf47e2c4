"""One tenant must not starve the rest (issue 14, item 5): per-job quotas on buffer bytes, sessions and
steps in flight; waiting Submits hold no gRPC thread and health answers on its own; buffers.sock serves a
bounded number of connections and cuts the ones that never say hello. Real daemons, real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.helpers import poll_for, run_all, steps_in_flight
from zend.api.zen.v1 import zen_pb2 as pb
from zend.buffers import SharedBufferError, wire
from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.protocol.health import health_status
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]


def grad(rows: int, dim: int, seed: int) -> SparseGrad:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, rows, (rows // 3,), generator=g)
    return SparseGrad(idx, torch.randn(rows // 3, dim, generator=g), rows)


def threads_of(c: LocalCluster, node: int = 0) -> int:
    return len(os.listdir(f"/proc/{c.procs[node].pid}/task"))


def two_trainers_sum(c: LocalCluster, job: str, steps: int = 2) -> None:
    """Job `job`'s two trainers on the node sum `steps` steps; each result is checked."""
    def trainer(rank: int) -> list[torch.Tensor]:
        with TrainerSession(c.socket_dir(0), job, c.token(job), rank, 2, timeout_s=30) as link:
            h = link.register("emb", (300, 8))
            return [link.allreduce(h, grad(300, 8, 10 * step + rank), step).to_dense() for step in range(steps)]

    results = run_all([lambda r=r: trainer(r) for r in range(2)], timeout_s=60)
    for got in results:
        assert not isinstance(got, BaseException), got
        for step in range(steps):
            torch.testing.assert_close(got[step], grad(300, 8, 10 * step).to_dense() + grad(300, 8, 10 * step + 1)
                                       .to_dense())


def test_a_job_at_its_buffer_and_session_quotas_is_refused_naming_them_and_another_job_goes_on(fresh_cluster):
    pool = 64 << 20  # the default job quota is half of it
    c = fresh_cluster(1, extra=["--log-format", "text", "--max-pool-bytes", str(pool), "--max-sessions-per-job", "2"])
    hogs = [TrainerSession(c.socket_dir(0), "hog", c.token("hog"), rank, 2, timeout_s=30) for rank in range(2)]
    try:
        hogs[0].buffers.alloc(24 << 20)
        with pytest.raises(SharedBufferError) as err:  # the job's other session: the quota is the job's
            hogs[1].buffers.alloc(16 << 20)
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert (f"alloc of {16 << 20} bytes refused: job 'hog' holds {24 << 20} bytes on this node, its quota is "
                f"{pool // 2} bytes (max_job_buffer_bytes)") in str(err.value)
        hogs[1].buffers.alloc(8 << 20)  # up to the quota: fine, and the session goes on
        with pytest.raises(grpc.RpcError) as rpc:
            TrainerSession(c.socket_dir(0), "crowd", c.token("crowd"), 0, 3, timeout_s=10)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert rpc.value.details() == ("job 'crowd' asks for local_world_size 3 trainers on this node, over its "
                                       "quota of 2 sessions (max_sessions_per_job)")
        # the pool still has room for everyone else: another job allocates and sums
        with TrainerSession(c.socket_dir(0), "other", c.token("other"), 0, 1, timeout_s=30) as other:
            assert other.buffers.alloc(16 << 20).nbytes == 16 << 20
        two_trainers_sum(c, "fair")
    finally:
        for link in hogs:
            link.close()


def test_waiting_submits_hold_no_grpc_thread_health_and_other_jobs_go_on(fresh_cluster):
    """70 Submits of one trainer wait for a partner that never comes, on a daemon with 4 gRPC threads: health
    answers within a second, another job opens, registers and sums by gRPC and on the socket, the daemon
    gains no thread per waiting Submit, and the job's 71st step is refused naming its quota."""
    waiting = 70
    c = fresh_cluster(1, extra=["--log-format", "text", "--grpc-workers", "4", "--max-submits-in-flight-per-job",
                                str(waiting)])
    address = f"unix:{os.path.join(c.socket_dir(0), 'zend.sock')}"
    before = threads_of(c)
    stuck = TrainerSession(c.socket_dir(0), "stuck", c.token("stuck"), 0, 2, timeout_s=30)  # rank 1 never comes
    calls: list[Any] = []
    try:
        handles = [stuck.register(f"t{i}", (10, 2)) for i in range(waiting)]
        empty = stuck.buffers.alloc(4096)
        for h in handles:
            calls.append(stuck.stub.Submit.future(pb.SubmitRequest(
                session_id=stuck.session_id, tensor_id=h.tensor_id, step=0, nnz=0,
                input=pb.BufferRef(buffer_id=empty.buffer_id), result=pb.BufferRef(buffer_id=h.result.buffer_id)),
                metadata=stuck.metadata, timeout=60))
        poll_for(lambda: steps_in_flight(c, 0) == waiting, 20, f"{waiting} steps waiting in the daemon")
        assert not any(call.done() for call in calls)

        for _ in range(5):
            t0 = time.monotonic()
            assert health_status(address, 3.0) == "SERVING"  # without its own capacity: DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 3.0
        t0 = time.monotonic()
        with TrainerSession(c.socket_dir(0), "other", c.token("other"), 0, 1, timeout_s=10) as other:
            h = other.register("emb", (100, 4))
            g = grad(100, 4, 7)
            torch.testing.assert_close(other.allreduce(h, g, 0).to_dense(), g.to_dense())  # on the socket
            other.steps_on_socket = False
            torch.testing.assert_close(other.allreduce(h, g, 1).to_dense(), g.to_dense())  # by gRPC Submit
        assert time.monotonic() - t0 < 15.0  # not the 60 s the waiting Submits hold out for
        assert threads_of(c) <= before + 10, "a thread per waiting Submit"

        with pytest.raises(StepFailed) as err:  # either way, the job is at its quota
            stuck.allreduce(stuck.register("one-more", (10, 2)), grad(10, 2, 0), 0)
        assert err.value.code == "RESOURCE_EXHAUSTED"
        assert (f"job 'stuck' has {waiting} steps waiting in the daemon on this node, its quota "
                f"(max_submits_in_flight_per_job {waiting}); step 0 of tensor 'one-more' is refused"
                ) == err.value.message
    finally:
        for call in calls:
            call.cancel()
        stuck.close()
    poll_for(lambda: steps_in_flight(c, 0) == 0, 10, "the abandoned steps gone")  # cancelled: nothing is left
    two_trainers_sum(c, "stuck")  # the job's quota is whole again


@pytest.fixture
def flood(request: pytest.FixtureRequest) -> Iterator[Callable[[str, int], subprocess.Popen[str]]]:
    """Starts connection floods (tests/daemon/connection_flood.py) in processes of their own; kills them after."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: str, n: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", "tests.daemon.connection_flood", path, str(n)], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and json.loads(proc.stdout.readline()) == {"opened": n}
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def look(proc: subprocess.Popen[str], command: str = "look") -> dict[str, Any]:
    """What the flood's connections got since its last look (`peek`: since the start, nothing marked seen)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())  # type: ignore[no-any-return]


def answered(proc: subprocess.Popen[str]) -> int:
    """How many of the flood's connections the daemon has answered (a message, or closed)."""
    seen = look(proc, "peek")
    return int(seen["closed"]) + sum(seen["errors"].values())


def test_idle_connections_to_buffers_sock_get_no_thread_each_and_an_honest_trainer_gets_in(fresh_cluster, flood):
    c = fresh_cluster(1, extra=["--log-format", "text"])
    path = os.path.join(c.socket_dir(0), "buffers.sock")
    before = threads_of(c)
    attacker = flood(path, 2000)
    poll_for(lambda: answered(attacker) >= 2000 - 64, 30, "the daemon's answers to the connections past 64")
    seen = look(attacker)
    assert seen["silent"] == 64 and seen["closed"] == 0, seen  # one process: 64 connections at most
    message = (f"connection refused: process {attacker.pid} holds 64 connections to the buffer socket, its "
               "limit (max_buffer_connections_per_pid 64)")
    assert seen["errors"] == {message: 2000 - 64}, seen
    assert threads_of(c) <= before + 64 + 4, "a thread per connection"
    two_trainers_sum(c, "honest")  # another process gets in (and its step connections too)
    log = c.log_path(0).read_text()
    assert f"refused a connection from pid {attacker.pid}" in log
    assert log.count("refused a connection") < 10, "a line per refused connection"


def test_a_silent_connection_is_cut_at_the_hello_deadline_and_a_full_socket_spares_established_sessions(
        fresh_cluster, flood):
    c = fresh_cluster(1, extra=["--log-format", "text", "--buffer-hello-timeout-s", "1",
                                "--max-buffer-connections", "40", "--max-buffer-connections-per-pid", "40"])
    path = os.path.join(c.socket_dir(0), "buffers.sock")
    for trickle in (False, True):  # says nothing; a hello's first byte every 0.2 s (each read alone is on time)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.settimeout(0.2)
            if trickle:
                s.sendall(wire.HEADER.pack(64))  # a 64-byte message follows, one byte at a time
            t0 = time.monotonic()
            while True:
                try:
                    message = wire.recv_message(s)
                    break
                except TimeoutError:
                    assert time.monotonic() - t0 < 8, "the silent connection was not cut"
                    if trickle:
                        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # cut: its answer waits
                            s.sendall(b" ")
            assert 0.9 < time.monotonic() - t0 < 6  # the 1 s deadline, on a loaded 2-core machine
            assert message.body == {"ok": False, "error": "no hello within 1 s: connection closed"}
            s.settimeout(2)
            assert s.recv(16) == b""

    with TrainerSession(c.socket_dir(0), "steady", c.token("steady"), 0, 1, timeout_s=30) as steady:
        h = steady.register("emb", (100, 4))
        steady.allreduce(h, grad(100, 4, 0), 0)  # its buffer and step connections are up
        attacker = flood(path, 100)
        poll_for(lambda: answered(attacker) >= 100 - 38, 30, "the daemon's answers to the connections past 40")
        seen = look(attacker)
        assert seen["silent"] == 40 - 2 and set(seen["errors"]) == {
            "connection refused: the daemon serves 40 connections on its buffer socket, its limit "
            "(max_buffer_connections 40); try again later"}, seen
        for step in (1, 2):  # established sessions go on while the socket is full
            g = grad(100, 4, step)
            torch.testing.assert_close(steady.allreduce(h, g, step).to_dense(), g.to_dense())
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.settimeout(5)
            assert "max_buffer_connections 40" in str(wire.recv_message(s).body["error"])
        # the flood's connections never said hello: cut at the 1 s deadline (within the 1.6 s once slept here)
        poll_for(lambda: look(attacker, "peek")["silent"] == 0, 1.6, "the silent connections cut")
        seen = look(attacker)
        assert seen["silent"] == 0 and seen["errors"] == {"no hello within 1 s: connection closed": 38}, seen
        two_trainers_sum(c, "late")
