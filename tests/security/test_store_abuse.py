"""The rendezvous store, attacked by someone who reaches its port and nothing else (no cluster secret, no
job token), over real daemons (issue 32). Each attack is followed by the honest job's exact sums on
every node: no code runs, no live node is left out, the job steps on.

The cluster is elastic (`zend store`, --elastic 1) with three nodes and --min-nodes 2, so that a forged
round could try to form a smaller generation; the store is capped at 256 MiB for the flood."""

from __future__ import annotations

import base64
import datetime
import json
import os
import pickle
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.helpers import node_status, poll_for
from tests.security.conftest import Tally, Target
from zend.cluster.local import LocalCluster, free_port
from zend.daemon.store_seal import MAC_BYTES, VERSION
from zend.protocol import paths
from zend.protocol.health import health_status
from zend.protocol.session import TrainerSession

pytestmark = pytest.mark.daemon

RUN_ID = "zen-zen"  # the elastic rendezvous of cluster id "zen" (LocalCluster's)
STATE_KEY = f"torch.rendezvous.{RUN_ID}"
EXTRA = ["--peer-timeout-s", "2", "--step-timeout-s", "20", "--connect-timeout-s", "60", "--log-format", "json",
         "--min-nodes", "2", "--scheme", "zen"]


def store_client(c: LocalCluster) -> Any:
    import torch.distributed as dist

    host, _, port = c.store.rpartition(":")
    return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=10))


def generations(c: LocalCluster) -> list[int]:
    return [node_status(c, n).generation for n in range(c.nodes)]


def node_counts(c: LocalCluster) -> list[int]:
    return [node_status(c, n).node_count for n in range(c.nodes)]


def logs(c: LocalCluster) -> str:
    return "".join(c.log_path(n).read_text(errors="replace") for n in range(c.nodes))


def current_round(c: LocalCluster) -> int:
    """The round in the sealed state (sealed, not hidden: the test reads it as a stranger could)."""
    blob = store_client(c).get(STATE_KEY)
    assert blob.startswith(VERSION), blob[:40]
    return int(pickle.loads(blob[len(VERSION) + MAC_BYTES:]).round)


def restart(c: LocalCluster, node: int) -> None:
    c.kill(node)
    c.start_node(node)
    c.wait_ready(node, 90)
    for n in range(c.nodes):
        c.wait_ready(n, 90)


class RunsCode:
    """A pickle that, unpickled, creates `path`: what torch's handler would do with it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def store_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    with LocalCluster(3, tmp_path_factory.mktemp("store-attacked"), elastic=True, extra=EXTRA,
                      store_extra=["--max-memory-bytes", str(256 << 20)]) as c:
        t = Target(c)
        t.honest_step(Tally(), "setup")
        yield t


def test_a_pickle_written_into_the_rendezvous_state_runs_nothing(store_target: Target, tally: Tally,
                                                                 tmp_path: Path) -> None:
    """torch's handler unpickles its state on every keep-alive and watcher poll: a stranger's pickle ran
    code in every daemon within 0.2 s. Now it is refused (not sealed) and the members write their round back."""
    c = store_target.cluster
    before = generations(c)
    marker = tmp_path / "pwned"
    attacker = store_client(c)
    # the point: the handlers get 2 s, then 3 s, to read (and run) each pickle
    attacker.set(STATE_KEY, base64.b64encode(pickle.dumps(RunsCode(marker))))  # as torch's c10d backend stores it
    time.sleep(2.0)
    attacker.set(STATE_KEY, pickle.dumps(RunsCode(marker)))  # and raw
    time.sleep(3.0)
    assert not marker.exists(), "a pickle from the store ran in a daemon"
    assert "store_value_refused" in logs(c)
    assert store_client(c).get(STATE_KEY).startswith(VERSION), "the members did not write their round back"
    assert generations(c) == before  # the running generation needed nothing new
    store_target.honest_step(tally, "store")


def test_a_forged_round_leaves_no_live_node_out_and_a_phantom_waiter_changes_nothing(
        store_target: Target, tally: Tally) -> None:
    """A round forced complete with 2 of 3 participants made the daemons form 2-node generations under
    --min-nodes 2 while the third was alive; a phantom in the wait list re-formed generations for ever."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    c = store_target.cluster
    before = generations(c)
    forged = _RendezvousState()
    forged.round = current_round(c) + 1
    forged.complete = True
    forged.participants = {_NodeDesc("127.0.0.1", 1, 0): 0, _NodeDesc("127.0.0.1", 2, 0): 1}
    forged.wait_list = {_NodeDesc("10.9.9.9", 666, 0)}
    now = datetime.datetime.now(datetime.UTC)
    forged.last_heartbeats = {n: now + datetime.timedelta(days=1) for n in (*forged.participants, *forged.wait_list)}
    attacker = store_client(c)
    for _ in range(5):  # written again and again, as each is refused and overwritten
        attacker.set(STATE_KEY, pickle.dumps(forged))
        time.sleep(1.0)  # the point: the attacker's pace, and 5 s for the daemons to (wrongly) re-form
    assert generations(c) == before and node_counts(c) == [3, 3, 3]
    store_target.honest_step(tally, "store")


def test_a_deleted_state_is_written_back_and_a_restarted_node_still_gets_in(store_target: Target,
                                                                           tally: Tally) -> None:
    """A deleted (or closed) round kept a restarted daemon out for good (it exited after 30 s)."""
    c = store_target.cluster
    before = generations(c)
    store_client(c).delete_key(STATE_KEY)
    time.sleep(2.0)  # the point: 2 s for the members to write their round back, and for nothing else to change
    assert store_client(c).get(STATE_KEY).startswith(VERSION)
    assert generations(c) == before
    restart(c, 2)
    after = generations(c)
    assert len(set(after)) == 1 and after[0] > before[0], (before, after)
    store_target.honest_step(tally, "store")


def test_a_generation_counter_set_to_garbage_or_2_63_is_not_read(store_target: Target, tally: Tally) -> None:
    """The generation was a counter in the store: 2^63-1 overflowed to -2^63 and garbage broke rejoin. It is
    now one more than the highest generation the round's members have been in."""
    c = store_target.cluster
    attacker = store_client(c)
    for value in (str(2**63 - 1), "garbage"):
        attacker.set("zen/zen/generation", value)
        before = generations(c)[0]
        restart(c, 1)
        assert generations(c) == [before + 1] * 3
    store_target.honest_step(tally, "store")


def test_forged_member_entries_redirect_no_dial_and_feed_no_step_numbers(store_target: Target,
                                                                         tally: Tally) -> None:
    """Rewriting a member's data-plane address made the others dial the attacker (who got the dialler's
    proof); job steps out of range raised ValueError in Ready and OpenSession. Entries for the next rounds,
    written before they start, are refused: nobody dials the attacker, and the job's step stays sane."""
    c = store_target.cluster
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    dialled: list[Any] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                dialled.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    attacker = store_client(c)
    uri = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    first = current_round(c) + 1
    for round_ in range(first, first + 4):  # the next rounds' keys, in the format zen once trusted
        for slot in range(3):
            entry = {"uri": uri, "rank": slot, "agreed": {}, "job_steps": {"honest": 2**63 - 1}}
            attacker.set(f"{STATE_KEY}.{round_}/zen/member/{slot}", json.dumps(entry))
    try:
        restart(c, 0)
        time.sleep(1.0)  # the point: a second more for a daemon to dial the stranger's address
    finally:
        done.set()
        listener.close()
    assert not dialled, "a daemon dialled the address a stranger wrote into the store"
    assert node_counts(c) == [3, 3, 3]
    with TrainerSession(c.socket_dir(1), "honest", c.token("honest"), 0, 1, timeout_s=30) as link:
        assert 0 <= link.ready(10).job_step < 2**62
    store_target.honest_step(tally, "store")


def test_a_store_flood_ends_the_store_not_the_job_and_a_restarted_store_gets_the_round_back(
        store_target: Target, tally: Tally) -> None:
    """The store's memory was unbounded (329 -> 734 MB in 0.6 s of writes). It is capped: past it the store
    ends (its supervisor restarts it); the running generation never needs it, and writes its round back."""
    c = store_target.cluster
    assert c.store_proc is not None
    attacker = store_client(c)
    chunk = b"x" * (8 << 20)
    with pytest.raises(Exception):  # noqa: B017 (torch's store errors: the store drops the flooder)
        for i in range(100):  # 800 MiB, over the 256 MiB cap
            attacker.set(f"flood/{i}", chunk)
    assert c.store_proc.wait(30) == 3, (c.workdir / "store.log").read_text(errors="replace")[-2000:]
    before = generations(c)
    store_target.honest_step(tally, "store")  # no store at all: the generation steps on
    c.start_store()  # what the supervisor does
    poll_for(lambda: store_client(c).check([STATE_KEY]) and store_client(c).get(STATE_KEY).startswith(VERSION), 15,
             "the members write their round into the restarted store", interval_s=0.2)
    assert generations(c) == before
    restart(c, 2)
    assert generations(c) == [before[0] + 1] * 3
    store_target.honest_step(tally, "store")


def test_the_store_listens_where_it_is_told_only(tmp_path: Path) -> None:
    """`zend store --listen 127.0.0.1:P` listened on every interface (*:P)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "zend", "store", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None and "serving on" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError):  # another address of this host: nothing listens there
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
    finally:
        proc.kill()
        proc.wait()


def test_the_one_shot_rendezvous_ignores_a_strangers_claim_and_entries(tmp_path: Path, tally: Tally) -> None:
    """One extra claim key (`zen/<cluster>/claim/1`) made both daemons exit ("rank 1 is already taken")."""
    import torch.distributed as dist

    c = LocalCluster(2, tmp_path, rendezvous=True, extra=["--log-format", "json", "--step-timeout-s", "20"])
    try:
        c.start_node(0)  # node 0 hosts the round's store and waits for node 1
        host, _, port = c.store.rpartition(":")
        try:
            attacker = poll_for(lambda: dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=5)),
                                60, "node 0's store up", interval_s=0.2, ignore=(Exception,))  # not up yet
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.log_tail(0)}") from None
        attacker.add("zen/zen/claim/1", 1)
        attacker.set("zen/zen/rank/1", b'{"uri": "tcp://127.0.0.1:1", "agreed": {}}')
        c.start_node(1)
        c.wait_ready(0, 60)
        c.wait_ready(1, 60)
        Target(c).honest_step(tally, "store")
    finally:
        c.close()


@pytest.fixture(scope="module")
def listener_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Target, int]]:
    grpc_port = free_port()
    with LocalCluster(2, tmp_path_factory.mktemp("listeners"), extra=[
            "--log-format", "json", "--step-timeout-s", "20", "--claim-timeout-s", "60"],
            node_extra={0: ["--grpc-listen", f"127.0.0.1:{grpc_port}"]}) as c:
        t = Target(c)
        t.honest_step(Tally(), "setup")
        yield t, grpc_port


def _flood(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break  # the listener refuses more: what a bound does
    return held


def test_idle_connections_to_the_metrics_and_operator_ports_starve_nothing(listener_target: tuple[Target, int],
                                                                          tally: Tally) -> None:
    """287 idle connections to the metrics port stalled health checks and trainers; 400 to the operator gRPC
    port made `zend health` time out and kept a new trainer out."""
    target, grpc_port = listener_target
    c = target.cluster
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held = _flood(c.metrics_ports[0], 300) + _flood(grpc_port, 400)
    try:  # the other listeners are untouched: the unix socket's health and trainers, the data plane
        started = time.monotonic()
        assert health_status(paths.grpc_address(c.socket_dir(0)), 5.0) == "SERVING"
        target.honest_step(tally, "listeners")
        assert time.monotonic() - started < 10
        # the flooded port itself: idle connections are closed after the handshake timeout (5 s), so it
        # answers again while the flood still holds its sockets open
        poll_for(lambda: health_status(f"127.0.0.1:{grpc_port}", 2.0) == "SERVING", 20,
                 "the operator port answers again while idle connections hold it", interval_s=0.5,
                 ignore=(grpc.RpcError,))
    finally:
        for s in held:
            s.close()
    def page() -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_ports[0]}/metrics", timeout=5) as r:
            return r.read()  # type: ignore[no-any-return]

    # the page is served again once the flood is gone
    assert b"zen_build_info" in poll_for(page, 15, "the metrics page", interval_s=0.5, ignore=(OSError,))


def test_a_scrape_flood_is_served_the_cached_page_and_the_job_steps_on(listener_target: tuple[Target, int],
                                                                       tally: Tally) -> None:
    target, _ = listener_target
    c = target.cluster
    url = f"http://127.0.0.1:{c.metrics_ports[0]}/metrics"
    stop, scrapes = threading.Event(), [0]

    def scrape() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    r.read()
                scrapes[0] += 1
            except OSError:
                pass

    threads = [threading.Thread(target=scrape, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    steps, deadline = 0, time.monotonic() + 60
    try:  # at least 5 steps, and on until the flood has really been one (fast steps end before 20 scrapes)
        while steps < 5 or (scrapes[0] <= 40 and time.monotonic() < deadline):
            target.honest_step(tally, "listeners")
            steps += 1
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert scrapes[0] > 20, (scrapes, steps)


def test_an_open_session_whose_reply_never_arrives_frees_its_local_rank(listener_target: tuple[Target, int]) -> None:
    """A failed OpenSession reply leaked the session: its local rank stayed taken for the claim timeout (60 s)."""
    from zend.api.zen.v1 import zen_pb2 as pb
    from zend.api.zen.v1 import zen_pb2_grpc as pb_grpc

    target, _ = listener_target
    c = target.cluster
    job = "leaky"
    with grpc.insecure_channel(paths.grpc_address(c.socket_dir(1))) as channel:
        stub = pb_grpc.TrainerStub(channel)
        request = pb.OpenSessionRequest(job_id=job, local_rank=0, local_world_size=1, pid=os.getpid())
        metadata = (("authorization", f"Bearer {c.token(job)}"),)
        for deadline_ms in (1, 2, 3, 5, 8, 12, 20) * 5:  # some reach the daemon, their replies arrive too late
            try:
                reply = stub.OpenSession(request, timeout=deadline_ms / 1000, metadata=metadata)
                stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=10, metadata=metadata)
            except grpc.RpcError as exc:  # too late; or the one before's session is still being closed
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or "already taken" in (exc.details() or ""), exc
    def opens() -> bool:
        try:
            with TrainerSession(c.socket_dir(1), job, c.token(job), 0, 1, timeout_s=10):
                return True
        except grpc.RpcError as exc:
            assert "already taken" in (exc.details() or ""), exc
            return False

    # within a moment, not the 60 s claim timeout
    poll_for(opens, 5, "local rank 0 free: no unanswered OpenSession holds it", interval_s=0.2)
