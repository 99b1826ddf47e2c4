"""Real zend daemons (one process per node) with trainers: sums, bad requests, failures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.helpers import node_status, poll_for, random_grad, run_all, status_code, status_details, steps_in_flight
from zend.api.zen.v1 import zen_pb2 as pb
from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed


@pytest.mark.daemon
def test_four_nodes_two_trainer_processes_each_get_the_reference_sum(cluster4):
    """8 trainer processes (zend.cluster.workload) push real-trace gradients; each checks every step's sum."""
    procs = []
    for node in range(4):
        for r in range(2):
            env = {**os.environ, "ZEN_JOB_TOKEN": cluster4.token("trace")}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "zend.cluster.workload", "--socket-dir", cluster4.socket_dir(node),
                 "--job", "trace", "--local-rank", str(r), "--local-world-size", "2", "--node", str(node),
                 "--nodes", "4", "--steps", "3", "--dim", "16"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == 3 and all('"ok": true' in line for line in lines), out


@pytest.mark.daemon
@pytest.mark.parametrize(("dtype", "dense", "average"), [(torch.float16, False, True), (torch.bfloat16, False, False),
                                                          (torch.float32, True, True)])
def test_every_dtype_dense_layout_and_average(cluster4, dtype, dense, average):
    job = f"kinds-{dtype}-{dense}"
    rows, dim, steps = 300, 8, 2

    def trainer(node: int, local: int) -> list[torch.Tensor]:
        with TrainerSession(cluster4.socket_dir(node), job, cluster4.token(job), local, 2) as link:
            h = link.register("w", (rows, dim), dtype=dtype, dense=dense, average=average)
            out = []
            for step in range(steps):
                g = random_grad(rows, dim, 100 * step + 10 * node + local, dtype)
                if dense:
                    g = SparseGrad(torch.arange(rows), g.to_dense(), rows, coalesced=True)
                out.append(link.allreduce(h, g, step).to_dense().float())
            return out

    results = run_all([lambda n=n, r=r: trainer(n, r) for n in range(4) for r in range(2)])
    for step in range(steps):
        ref = sum(random_grad(rows, dim, 100 * step + 10 * n + r, dtype).to_dense().float()
                  for n in range(4) for r in range(2))
        assert isinstance(ref, torch.Tensor)
        if average:
            ref = ref / 8
        tol = 1e-5 if dtype == torch.float32 else 5e-2
        for got in results:
            assert not isinstance(got, BaseException), got
            torch.testing.assert_close(got[step], ref, rtol=tol, atol=tol)


def _one_trainer_per_node(cluster, job, body, nodes=4):  # type: ignore[no-untyped-def]
    def run(node: int):  # type: ignore[no-untyped-def]
        with TrainerSession(cluster.socket_dir(node), job, cluster.token(job), 0, 1, timeout_s=30) as link:
            return body(node, link)
    return run_all([lambda n=n: run(n) for n in range(nodes)])


@pytest.mark.daemon
def test_nodes_that_describe_a_tensor_differently_all_get_invalid_argument(cluster4):
    def body(node, link):  # type: ignore[no-untyped-def]
        h = link.register("emb", (100, 16 if node == 2 else 8))
        return link.allreduce(h, random_grad(100, 16 if node == 2 else 8, node), 0)

    results = _one_trainer_per_node(cluster4, "mismatch", body)
    for r in results:
        assert status_code(r) == "INVALID_ARGUMENT"
        assert "node 2 has shape=[100, 16] but node 0 has shape=[100, 8]" in status_details(r)


@pytest.mark.daemon
def test_steps_by_grpc_and_on_the_buffer_socket_are_the_same_step(cluster4):
    """Half the nodes submit by gRPC, half on the socket: one sum, the same bits; errors alike."""
    def body(node, link):  # type: ignore[no-untyped-def]
        link.steps_on_socket = node % 2 == 0
        h = link.register("emb", (200, 8))
        out = [link.allreduce(h, random_grad(200, 8, 10 * step + node), step) for step in range(3)]
        assert (link._step_clients != []) == link.steps_on_socket  # the path it was told to take
        h.tensor_id += 1000
        try:
            link.allreduce(h, random_grad(200, 8, 0), 3)
        except StepFailed as exc:  # the same, whichever way the step went
            return out, exc.code, exc.message
        raise AssertionError("a step of an unknown tensor went through")

    results = _one_trainer_per_node(cluster4, "two-ways", body)
    for step in range(3):
        ref = sum(random_grad(200, 8, 10 * step + n).to_dense() for n in range(4))
        for got, _, _ in results:
            torch.testing.assert_close(got[step].to_dense(), ref, rtol=1e-5, atol=1e-5)
            assert torch.equal(got[step].values, results[0][0][step].values)
    errors = {(code, details) for _, code, details in results}
    assert len(errors) == 1 and next(iter(errors))[0] == "NOT_FOUND", errors  # the same words either way


def _session(cluster, node=0, job="bad", local_world_size=1):  # type: ignore[no-untyped-def]
    return TrainerSession(cluster.socket_dir(node), job, cluster.token(job), 0, local_world_size, timeout_s=10)


@pytest.mark.daemon
def test_bad_requests_get_their_status_and_a_message_naming_the_problem(cluster4):
    link = _session(cluster4)
    try:
        h = link.register("emb", (100, 4))
        stub, md, sid = link.stub, link.metadata, link.session_id
        good_in = link.buffers.alloc(4096)

        def submit(**kw):  # type: ignore[no-untyped-def]
            req = {"session_id": sid, "tensor_id": h.tensor_id, "step": 0, "nnz": 1,
                   "input": pb.BufferRef(buffer_id=good_in.buffer_id), "result": pb.BufferRef(
                       buffer_id=h.result.buffer_id)}
            req.update(kw)
            with pytest.raises(grpc.RpcError) as err:
                stub.Submit(pb.SubmitRequest(**req), metadata=md, timeout=10)
            return err.value.code().name, err.value.details()

        assert submit(tensor_id=12345) == ("NOT_FOUND", "tensor id 12345 is not registered in job 'bad'")
        code, msg = submit(nnz=10_000)
        assert code == "INVALID_ARGUMENT" and "holds 4096 bytes" in msg and "nnz=10000" in msg
        good_in.view(torch.int64, 0, 1).fill_(100)
        code, msg = submit()
        assert code == "INVALID_ARGUMENT" and "index 100 out of range for 100 rows" in msg
        code, msg = submit(input=pb.BufferRef(buffer_id="nope"))
        assert code == "INVALID_ARGUMENT" and "'nope'" in msg
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterTensor(pb.RegisterTensorRequest(session_id=sid, name="x", shape=[4], dtype=9,
                                                         layout=pb.DENSE), metadata=md, timeout=10)
        assert err.value.code().name == "INVALID_ARGUMENT" and "dtype 9" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            link.register("emb", (100, 5))
        assert err.value.code().name == "INVALID_ARGUMENT" and "already registered" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterTensor(pb.RegisterTensorRequest(session_id=sid, name="x" * (2 << 20), shape=[4],
                                                         dtype=pb.FLOAT32, layout=pb.DENSE), metadata=md, timeout=10)
        assert err.value.code().name == "RESOURCE_EXHAUSTED"
        # another job's token, and another job's session
        other = cluster4.token("other")
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(pb.SubmitRequest(session_id=sid, tensor_id=h.tensor_id), metadata=(
                ("authorization", f"Bearer {other}"),), timeout=10)
        assert err.value.code().name == "UNAUTHENTICATED" and "not job 'bad'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(pb.OpenSessionRequest(job_id="bad", local_world_size=1), metadata=(
                ("authorization", f"Bearer {other}"),), timeout=10)
        assert err.value.code().name == "UNAUTHENTICATED"
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(pb.OpenSessionRequest(job_id="bad", local_world_size=1), timeout=10)
        assert err.value.code().name == "UNAUTHENTICATED" and "authorization" in err.value.details()
        with _session(cluster4, job="other") as intruder:
            with pytest.raises(grpc.RpcError) as err:  # job 'other' cannot reach job 'bad''s tensor
                intruder.stub.Submit(pb.SubmitRequest(session_id=intruder.session_id, tensor_id=h.tensor_id,
                                                      input=pb.BufferRef(buffer_id=good_in.buffer_id),
                                                      result=pb.BufferRef(buffer_id=h.result.buffer_id)),
                                     metadata=intruder.metadata, timeout=10)
            assert err.value.code().name == "NOT_FOUND" and "job 'other'" in err.value.details()
    finally:
        link.close()
    # garbage on both sockets, then the daemon still serves a full step on every node
    for name in ("zend.sock", "buffers.sock"):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.path.join(cluster4.socket_dir(0), name))
            s.sendall(os.urandom(4096))
            s.settimeout(5)
            with contextlib.suppress(OSError):  # until the daemon drops it (or 5 s: it may wait for more)
                while s.recv(4096):
                    pass
    results = _one_trainer_per_node(cluster4, "after-garbage", lambda node, link: link.allreduce(
        link.register("emb", (50, 2)), random_grad(50, 2, node), 0).to_dense())
    ref = sum(random_grad(50, 2, n).to_dense() for n in range(4))
    for r in results:
        assert not isinstance(r, BaseException), r
        torch.testing.assert_close(r, ref)


@pytest.mark.daemon
def test_a_session_never_connected_expires_and_frees_its_local_rank(fresh_cluster):
    """A trainer that died between OpenSession and its buffer connection must not hold its rank forever."""
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc

    c = fresh_cluster(1, extra=["--claim-timeout-s", "1"])
    md = (("authorization", f"Bearer {c.token('orphan')}"),)
    with grpc.insecure_channel(f"unix:{os.path.join(c.socket_dir(0), 'zend.sock')}") as channel:
        stub = pb_grpc.TrainerStub(channel)
        open_rank0 = pb.OpenSessionRequest(job_id="orphan", local_rank=0, local_world_size=1, pid=1)
        stub.OpenSession(open_rank0, metadata=md, timeout=10)  # and never connects buffers.sock
        with pytest.raises(grpc.RpcError) as err:  # another process: refused
            stub.OpenSession(pb.OpenSessionRequest(job_id="orphan", local_rank=0, local_world_size=1, pid=2),
                             metadata=md, timeout=10)
        assert err.value.code().name == "FAILED_PRECONDITION" and "already taken" in err.value.details()
        # the same process again (its first reply never reached it): it replaces the session it never claimed
        stub.OpenSession(open_rank0, metadata=md, timeout=10)
        open_rank0 = pb.OpenSessionRequest(job_id="orphan", local_rank=0, local_world_size=1, pid=3)

        def reopened() -> bool:
            try:
                again = stub.OpenSession(open_rank0, metadata=md, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code().name == "FAILED_PRECONDITION", exc.details()
                return False
            stub.CloseSession(pb.CloseSessionRequest(session_id=again.session_id), metadata=md, timeout=10)
            return True

        # expired after about 1 s (checked every 0.5 s)
        poll_for(reopened, 15, "local rank 0 free again once the unconnected session expired", interval_s=0.2)
    assert "session_expired" in c.log_path(0).read_text()
    link = _session(c, job="orphan")  # a trainer that does connect keeps its session past the timeout
    try:
        time.sleep(2.0)  # the point: past the 1 s claim timeout, the connected session is still there
        assert link.allreduce(link.register("emb", (10, 2)), random_grad(10, 2, 0), 0).to_dense().shape == (10, 2)
    finally:
        link.close()


@pytest.mark.daemon
def test_deadline_exceeded_when_a_local_trainer_never_submits(cluster4):
    with _session(cluster4, job="late", local_world_size=2) as link:
        h = link.register("emb", (10, 2))
        t0 = time.monotonic()
        with pytest.raises(StepFailed) as err:
            link.allreduce(h, random_grad(10, 2, 0), 0, timeout_s=1.5)
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - t0 < 5


@pytest.mark.daemon
def test_repeated_submission_returns_the_same_result(cluster4):
    def body(node, link):  # type: ignore[no-untyped-def]
        h = link.register("emb", (40, 2))
        first = link.allreduce(h, random_grad(40, 2, node), 7)
        again = link.allreduce(h, random_grad(40, 2, node + 100), 7)  # step 7 again: not summed twice
        return first.to_dense(), again.to_dense()

    for first, again in _one_trainer_per_node(cluster4, "repeat", body):
        torch.testing.assert_close(first, again)


@pytest.mark.daemon
def test_status_reports_peers_sessions_and_tensors(cluster4):
    run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir", cluster4.socket_dir(1)],
                         capture_output=True, text=True, timeout=60, env=cluster4.env)  # the secret: the full view
    assert run.returncode == 0, run.stderr
    import json

    status = json.loads(run.stdout)
    assert status["node_rank"] == 1 and status["node_count"] == 4 and status["transport"] == "tcp"
    assert sorted(p["rank"] for p in status["peers"]) == [0, 2, 3]
    assert all(p["connected"] for p in status["peers"])
    assert any(t["name"] == "wte" and t["steps"] >= 1 for t in status["tensors"])


@pytest.mark.daemon
def test_status_and_health_find_the_daemon_through_zen_socket_dir(cluster4):
    """The one variable the client reads too; the old ZEND_SOCKET_DIR still works, with a deprecation line."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEN_SOCKET_DIR", "ZEND_SOCKET_DIR")}
    run = subprocess.run([sys.executable, "-m", "zend", "health"], capture_output=True, text=True, timeout=60,
                         env={**env, "ZEN_SOCKET_DIR": cluster4.socket_dir(2)})
    assert run.returncode == 0 and cluster4.socket_dir(2) in run.stdout and "SERVING" in run.stdout, run.stderr
    assert "deprecated" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "zend", "status", "--json"], capture_output=True, text=True, timeout=60,
                         env={**env, "ZEND_SOCKET_DIR": cluster4.socket_dir(3)})
    assert run.returncode == 0 and '"node_rank": 3' in run.stdout, run.stderr
    assert "$ZEND_SOCKET_DIR is deprecated" in run.stderr and "$ZEN_SOCKET_DIR" in run.stderr


def _operator_calls(address: str):  # type: ignore[no-untyped-def]
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.OperatorStub(channel)


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.mark.daemon
def test_the_operator_api_needs_the_operator_token_and_undrain_restores_serving(fresh_cluster):
    """Over --grpc-listen (TCP) and the unix socket: Status without the operator token names no job, tensor,
    pid or address; Drain with a wrong or no token is UNAUTHENTICATED and changes nothing; with the token it
    drains (NOT_SERVING, steps refused), and Undrain admits steps again (SERVING, a step goes through)."""
    from zend.cluster.local import free_port
    from zend.protocol.health import health_status

    tcp = f"127.0.0.1:{free_port()}"
    c = fresh_cluster(1, extra=["--log-format", "text", "--grpc-listen", tcp])
    unix = f"unix:{os.path.join(c.socket_dir(0), 'zend.sock')}"
    operator = c.operator_token()
    assert operator != c.token("secret-job") and len(operator) == 64
    with TrainerSession(c.socket_dir(0), "secret-job", c.token("secret-job"), 0, 1, timeout_s=30) as link:
        h = link.register("hidden_embedding", (50, 2))
        link.allreduce(h, random_grad(50, 2, 1), 0)
        for address in (tcp, unix):
            channel, stub = _operator_calls(address)
            with channel:
                redacted = stub.Status(pb.StatusRequest(), timeout=10)
                full = stub.Status(pb.StatusRequest(), timeout=10, metadata=_bearer(operator))
            # the full view names them, so their absence below is the redaction's doing
            assert not full.redacted and full.sessions[0].job_id == "secret-job"
            assert full.sessions[0].pid == os.getpid() and full.tensors[0].name == "hidden_embedding"
            wire = redacted.SerializeToString()
            assert redacted.redacted and b"secret-job" not in wire and b"hidden_embedding" not in wire
            assert not redacted.sessions and not redacted.tensors  # where pids, shapes and job ids live
            assert (redacted.session_count, redacted.tensor_count) == (1, 1)
            assert (redacted.node_rank, redacted.node_count, redacted.membership) == (0, 1, "static")

        channel, stub = _operator_calls(tcp)
        with channel:
            for metadata in ([], _bearer(c.token("secret-job")), _bearer("0" * 64), [("authorization", operator)]):
                for call, request in ((stub.Drain, pb.DrainRequest(timeout_seconds=1)),
                                      (stub.Undrain, pb.UndrainRequest())):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(request, timeout=10, metadata=metadata)
                    assert status_code(refused.value) == "UNAUTHENTICATED", metadata
                    assert "operator token" in refused.value.details()
            with pytest.raises(grpc.RpcError) as refused:  # a wrong token is refused, not redacted
                stub.Status(pb.StatusRequest(), timeout=10, metadata=_bearer(c.token("secret-job")))
            assert status_code(refused.value) == "UNAUTHENTICATED"
            assert health_status(tcp, 5) == "SERVING"
            torch.testing.assert_close(link.allreduce(h, random_grad(50, 2, 2), 1).to_dense(),
                                       random_grad(50, 2, 2).to_dense())  # still serving steps

            drained = stub.Drain(pb.DrainRequest(timeout_seconds=5), timeout=30, metadata=_bearer(operator))
            assert (drained.completed, drained.abandoned) == (0, 0)
            assert health_status(tcp, 5) == "NOT_SERVING" and health_status(unix, 5) == "NOT_SERVING"
            with pytest.raises(StepFailed) as draining:
                link.allreduce(h, random_grad(50, 2, 3), 2)
            assert status_code(draining.value) == "UNAVAILABLE" and "draining" in status_details(draining.value)

            undrained = stub.Undrain(pb.UndrainRequest(), timeout=10, metadata=_bearer(operator))
            assert undrained.serving and undrained.reason == ""
            assert health_status(tcp, 5) == "SERVING" and health_status(unix, 5) == "SERVING"
            assert not stub.Status(pb.StatusRequest(), timeout=10).draining
            out = link.allreduce(h, random_grad(50, 2, 3), 2)
            torch.testing.assert_close(out.to_dense(), random_grad(50, 2, 3).to_dense())
    assert "operator call refused" in c.log_path(0).read_text()


@pytest.mark.daemon
def test_the_trainer_service_is_on_tcp_only_when_enabled(fresh_cluster):
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc
    from zend.cluster.local import free_port

    def open_session(address: str, token: str):  # type: ignore[no-untyped-def]
        with grpc.insecure_channel(address) as channel:
            return pb_grpc.TrainerStub(channel).OpenSession(
                pb.OpenSessionRequest(job_id="j", local_rank=0, local_world_size=1, pid=os.getpid()), timeout=10,
                metadata=_bearer(token))

    off, on = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    default = fresh_cluster(1, extra=["--log-format", "text", "--grpc-listen", off])
    with pytest.raises(grpc.RpcError) as refused:
        open_session(off, default.token("j"))
    assert status_code(refused.value) == "UNIMPLEMENTED"
    assert open_session(f"unix:{os.path.join(default.socket_dir(0), 'zend.sock')}", default.token("j")).session_id
    enabled = fresh_cluster(1, extra=["--log-format", "text", "--grpc-listen", on, "--grpc-listen-trainers", "1"])
    assert open_session(on, enabled.token("j")).session_id
    log = enabled.log_path(0).read_text()
    assert "WARNING" in log and "Trainer service is served on TCP" in log
    assert "Trainer service is served on TCP" not in default.log_path(0).read_text()


@pytest.mark.daemon
def test_a_killed_peer_daemon_aborts_the_step_for_every_trainer_in_bounded_time(fresh_cluster):
    c = fresh_cluster(4, extra=["--peer-timeout-s", "5", "--step-timeout-s", "60", "--log-format", "text"])
    start = time.monotonic()

    def body(node: int):  # type: ignore[no-untyped-def]
        with TrainerSession(c.socket_dir(node), "j", c.token("j"), 0, 1, timeout_s=60) as link:
            h = link.register("emb", (100, 4))
            if node == 3:
                poll_for(lambda: all(steps_in_flight(c, n) for n in range(3)), 20, "the step open on nodes 0-2")
                c.kill(3, signal.SIGKILL)  # mid-step: nodes 0-2 are waiting for node 3's messages
                return None
            return link.allreduce(h, random_grad(100, 4, node), 0)

    results = run_all([lambda n=n: body(n) for n in range(4)])
    elapsed = time.monotonic() - start
    for r in results[:3]:
        assert status_code(r) == "ABORTED" and "rank 3" in status_details(r), r
    assert elapsed < 20, f"took {elapsed:.1f} s"


@pytest.mark.daemon
def test_a_killed_trainer_frees_its_buffers_and_fails_its_partners_step(fresh_cluster):
    c = fresh_cluster(1, extra=["--log-format", "text"])
    script = (
        "import sys, time, torch\n"
        "from zend.protocol.session import TrainerSession\n"
        "from zend.core.sparse import SparseGrad\n"
        f"link = TrainerSession({c.socket_dir(0)!r}, 'j', {c.token('j')!r}, 1, 2)\n"
        "h = link.register('emb', (1000, 64))\n"
        "link.buffers.alloc(8 << 20)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")
    victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
        with TrainerSession(c.socket_dir(0), "j", c.token("j"), 0, 2, timeout_s=30) as partner:
            h = partner.register("emb", (1000, 64))

            def submit():  # type: ignore[no-untyped-def]
                return partner.allreduce(h, random_grad(1000, 64, 1), 0)

            def kill():  # type: ignore[no-untyped-def]
                poll_for(lambda: steps_in_flight(c, 0), 10, "the partner's step open, waiting for the victim")
                victim.kill()

            t0 = time.monotonic()
            result, _ = run_all([submit, kill])
            assert status_code(result) == "ABORTED" and "disconnected" in status_details(result)
            assert time.monotonic() - t0 < 10
            mine = h.result.nbytes + h.input.nbytes  # what the partner still holds
            poll_for(lambda: pool_bytes(c, 0) <= mine, 10, "the victim's buffers freed")
            assert pool_bytes(c, 0) == mine
    finally:
        victim.kill()
        victim.wait()


def pool_bytes(cluster, node: int) -> int:  # type: ignore[no-untyped-def]
    return int(node_status(cluster, node).buffer_pool_bytes)


@pytest.mark.daemon
def test_bad_config_and_a_port_that_will_not_bind_fail_at_once(tmp_path):
    env = {**os.environ, "ZEN_CLUSTER_SECRET": "x" * 32}
    run = subprocess.run([sys.executable, "-m", "zend", "serve", "--scheme", "magic"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 2 and "scheme='magic' (from flag)" in run.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "zend", "serve", "--socket-dir", str(tmp_path),
                              "--metrics-host", "127.0.0.1", "--metrics-port", str(port)],
                             capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 1 and "Address already in use" in run.stderr, run.stderr
        assert time.monotonic() - t0 < 30
    run = subprocess.run([sys.executable, "-m", "zend", "serve", "--socket-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "ZEN_CLUSTER_SECRET": "short"})
    assert run.returncode == 2 and "at least 16 are required" in run.stderr


def _sum_on_every_node(cluster, nodes, job="j"):  # type: ignore[no-untyped-def]
    results = _one_trainer_per_node(cluster, job, lambda node, link: link.allreduce(
        link.register("emb", (64, 4)), random_grad(64, 4, node), 0).to_dense(), nodes=nodes)
    ref = sum(random_grad(64, 4, n).to_dense() for n in range(nodes))
    for r in results:
        assert not isinstance(r, BaseException), r
        torch.testing.assert_close(r, ref)


@pytest.mark.daemon
def test_rendezvous_through_torch_tcpstore(fresh_cluster):
    c = fresh_cluster(3, rendezvous=True, extra=["--log-format", "text"])
    _sum_on_every_node(c, 3)
    run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir", c.socket_dir(2)],
                         capture_output=True, text=True, timeout=60, env=c.env)  # the store's address: full view
    assert '"membership": "rendezvous tcpstore://127.0.0.1:' in run.stdout and '"generation": 1' in run.stdout


class TorchrunEnvCluster(LocalCluster):
    """Daemons started with `--rendezvous env` in the environment a torchrun job's node has: node-level
    GROUP_RANK / GROUP_WORLD_SIZE, and per-process RANK / WORLD_SIZE / MASTER_PORT that zend must ignore."""

    def __init__(self, nodes: int, workdir: Path, **kwargs: Any):
        super().__init__(nodes, workdir, rendezvous=True, **kwargs)
        self.port = self.store.rpartition(":")[2]
        self.base_env = dict(self.env)

    def argv(self, node: int) -> list[str]:
        argv = super().argv(node)
        for flag in ("--rank", "--world-size", "--rendezvous"):  # each with its value
            i = argv.index(flag)
            del argv[i:i + 2]
        return [*argv, "--rendezvous", "env"]

    def start_node(self, node: int) -> None:
        self.env = {**self.base_env, "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(self.nodes),
                    "MASTER_ADDR": "127.0.0.1", "ZEN_RENDEZVOUS_PORT": self.port,
                    "RANK": str(4 * node + 3), "WORLD_SIZE": str(4 * self.nodes), "MASTER_PORT": "1"}
        super().start_node(node)


@pytest.mark.daemon
def test_rendezvous_env_takes_torchruns_node_level_variables(tmp_path):
    with TorchrunEnvCluster(2, tmp_path, extra=["--log-format", "text"]) as c:
        _sum_on_every_node(c, 2)
        run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir", c.socket_dir(1)],
                             capture_output=True, text=True, timeout=60, env=c.base_env)
        assert f'"membership": "rendezvous tcpstore://127.0.0.1:{c.port}' in run.stdout, run.stdout


@pytest.mark.daemon
def test_ucx_data_plane_between_daemons(fresh_cluster):
    pytest.importorskip("ucxx", reason="ucxx-cu12 is installed by `make` (extra 'ucx')")
    c = fresh_cluster(2, transport="ucx", extra=["--log-format", "text"], env={"UCX_TLS": "tcp"})
    _sum_on_every_node(c, 2)
    run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir", c.socket_dir(0)],
                         capture_output=True, text=True, timeout=60)
    assert '"transport": "ucx"' in run.stdout and '"tcp"' in run.stdout, run.stdout
    # an idle daemon sleeps: UCX's blocking progress mode kept a core busy polling its links
    before = [_cpu_seconds(p.pid) for p in c.procs.values()]
    time.sleep(3.0)  # the point: the idle window measured
    used = [_cpu_seconds(p.pid) - b for p, b in zip(c.procs.values(), before, strict=True)]
    assert max(used) < 1.0, f"idle daemons used {used} CPU seconds in 3 s"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.daemon
def test_sigterm_drains_the_step_in_flight_then_stops(fresh_cluster):
    c = fresh_cluster(2, extra=["--log-format", "text", "--drain-timeout-s", "20"])

    def node0(node, link):  # type: ignore[no-untyped-def]
        h = link.register("emb", (64, 4))
        if node == 1:
            poll_for(lambda: steps_in_flight(c, 0), 20, "node 0's step in flight, waiting for node 1")
            os.kill(c.procs[0].pid, signal.SIGTERM)
            # node 0 is draining: it refuses new steps, finishes this one
            poll_for(lambda: node_status(c, 0).draining, 20, "node 0 draining", ignore=(grpc.RpcError,))
        return link.allreduce(h, random_grad(64, 4, node), 0).to_dense()

    t0 = time.monotonic()
    results = _one_trainer_per_node(c, "drain", node0, nodes=2)
    ref = random_grad(64, 4, 0).to_dense() + random_grad(64, 4, 1).to_dense()
    for r in results:  # the step in flight completed on both nodes
        assert not isinstance(r, BaseException), r
        torch.testing.assert_close(r, ref)
    assert c.procs[0].wait(20) == 0
    log = c.log_path(0).read_text()
    assert "signal received, draining" in log and "drained" in log
    assert time.monotonic() - t0 < 30


@pytest.mark.daemon
@pytest.mark.parametrize("transport", ["auto", "ucx"])
def test_a_daemon_that_loaded_ucx_exits_on_sigterm_within_seconds(tmp_path, transport):  # type: ignore[no-untyped-def]
    """auto's probe loads UCX on the main thread, where ucxx's notifier thread is born a non-daemon
    thread: such a daemon once waited for it at exit forever (until SIGKILL; a pod's whole grace
    period). ucx:// creates it on its daemon loop thread; that case guards the clean exit too."""
    pytest.importorskip("ucxx", reason="ucxx is not installed (install the `ucx` extra)")
    scheme = "ucx" if transport == "ucx" else "tcp"
    with LocalCluster(2, tmp_path, transport=scheme, extra=["--transport", transport, "--log-format", "text"]) as c:
        if transport == "auto":  # the probe really loaded UCX (else there is no thread to wait for)
            for node in c.procs:
                assert "transport auto -> tcp: ranks share a host" in c.log_path(node).read_text(), c.log_tail(node)
        t0 = time.monotonic()
        for proc in c.procs.values():
            os.kill(proc.pid, signal.SIGTERM)
        for node, proc in c.procs.items():
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {node} ({transport}) still runs 30 s after SIGTERM:\n{c.log_tail(node)}")
            assert code == 0, c.log_tail(node)
            assert "daemon stopped" in c.log_path(node).read_text()
        assert time.monotonic() - t0 < 30


@pytest.mark.netns
def test_zend_cluster_in_emulated_network_namespaces():
    from zend.cluster.netns import available

    reason = available()
    if reason:
        pytest.skip(f"emulated cluster: {reason}")
    run = subprocess.run([sys.executable, "-m", "zend", "cluster", "--nodes", "3", "--trainers", "1", "--steps",
                          "2", "--dim", "8", "--emulated", "1000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "network namespaces at 1000.0 Mbit/s" in run.stdout
    assert "6 trainer-steps, 0 wrong, 0 trainers failed" in run.stdout
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "zen" not in leftover, leftover


@pytest.mark.daemon
@pytest.mark.parametrize("scheme", ["dense", "auto"])
def test_every_node_gets_exactly_the_rows_sent_whatever_the_scheme(fresh_cluster, scheme):
    """Two nodes x two trainers send rows {0, 3, 5} / {3} and {7} / {} of an 8-row tensor (row 3 sums
    to zero): every trainer gets rows 0, 3, 5, 7 back, not the tensor's 8, at every step; auto's trials
    on the first steps run every candidate, the dense ring among them (a tensor this small is not pruned)."""
    c = fresh_cluster(2, extra=["--scheme", scheme, "--log-format", "text", "--step-timeout-s", "30"])
    sent = {(0, 0): ([0, 3, 5], [1.0, 2.0, 1.0]), (0, 1): ([3], [-2.0]), (1, 0): ([7], [5.0]), (1, 1): ([], [])}

    def trainer(node: int, local: int) -> tuple[list[SparseGrad], set[str]]:
        rows, values = sent[(node, local)]
        with TrainerSession(c.socket_dir(node), "rows", c.token("rows"), local, 2, timeout_s=30) as link:
            h = link.register("w", (8, 4))
            grad = SparseGrad(torch.tensor(rows, dtype=torch.int64), torch.tensor(values).unsqueeze(1).repeat(1, 4), 8)
            outs, ran = [], set()
            for step in range(16):
                outs.append(link.allreduce(h, grad, step))
                ran.add(h.last_reply.scheme)
            return outs, ran

    results = run_all([lambda n=n, r=r: trainer(n, r) for n in range(2) for r in range(2)])
    for got in results:
        assert not isinstance(got, BaseException), got
        outs, ran = got
        assert ("auto:dense" in ran) if scheme == "auto" else ran == {"dense"}, ran
        for out in outs:
            assert out.indices.tolist() == [0, 3, 5, 7]
            assert out.values[:, 0].tolist() == [1.0, 0.0, 1.0, 5.0]


@pytest.mark.daemon
@pytest.mark.parametrize("dense", [False, True])
def test_buffers_that_show_writes_only_once_published_still_give_every_trainer_the_sum(fresh_cluster, monkeypatch,
                                                                                       dense):
    """Device buffers' writes reach the other process only after the writer orders its stream. The fenced
    double (zend/buffers/fenced.py) behaves so on a CPU: a hand-off that skips `publish` or `acquire` (the
    trainer before submitting, the daemon before answering) gives a stale, wrong sum here."""
    from zend.buffers import fenced

    monkeypatch.setenv(fenced.ENV, "1")  # the trainers here, and the daemons (they inherit it)
    c = fresh_cluster(2, extra=["--log-format", "text", "--step-timeout-s", "30"])
    rows, dim, steps = 64, 4, 3

    def part(step: int, node: int, local: int) -> SparseGrad:
        g = random_grad(rows, dim, 100 * step + 10 * node + local)
        return SparseGrad(torch.arange(rows), g.to_dense(), rows, coalesced=True) if dense else g

    def trainer(node: int, local: int) -> list[torch.Tensor]:
        with TrainerSession(c.socket_dir(node), "fenced", c.token("fenced"), local, 2, timeout_s=30) as link:
            h = link.register("w", (rows, dim), dense=dense)
            assert h.result.device == fenced.DEVICE
            return [link.allreduce(h, part(step, node, local), step).to_dense() for step in range(steps)]

    results = run_all([lambda n=n, r=r: trainer(n, r) for n in range(2) for r in range(2)])
    for step in range(steps):
        want = sum(part(step, n, r).to_dense() for n in range(2) for r in range(2))
        for got in results:
            assert not isinstance(got, BaseException), got
            torch.testing.assert_close(got[step], want, rtol=1e-5, atol=1e-5)
