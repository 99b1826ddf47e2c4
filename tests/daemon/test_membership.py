"""Membership: static validation, torchrun's environment, and rendezvous across real processes.

The rendezvous tests share four long-lived rank processes (torch imports once per process, and
the machine has two cores); each test gives them a fresh store port and cluster id, and the
module's teardown kills them whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from zend.cluster.local import free_port
from zend.daemon.membership import (
    MembershipError,
    RendezvousTimeoutError,
    check_agreement,
    from_environment,
    rendezvous,
    static_membership,
)
from zend.daemon.settings import AUTO_RANK
from zend.transport.handshake import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"membership-test-secret-0123456789"
PEERS = ["tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000", "ucx://10.0.0.3:7001", "tcp://10.0.0.4:7000"]

# One launcher imports torch once and forks a rank process per pair of pipe fds (argv[1]); each
# rank runs a rendezvous per JSON line it reads and answers "RESULT {json}". Forking before any
# store exists is safe (no threads yet) and spares two shared cores three more torch imports.
WORKER = r"""
import dataclasses, json, os, sys, time
import torch.distributed
from zend.daemon.membership import rendezvous

def serve(fd_in, fd_out):
    with os.fdopen(fd_in) as commands, os.fdopen(fd_out, "w") as out:
        print("READY", file=out, flush=True)
        for line in commands:
            cmd = json.loads(line)
            start = time.monotonic()
            try:
                m = rendezvous(cmd["host"], cmd["port"], cmd["rank"], cmd["world_size"], cmd["uri"],
                               cluster_id=cmd["cluster_id"], agreed=cmd["agreed"], timeout_s=cmd["timeout_s"],
                               secret=bytes.fromhex(cmd["secret"]))
                result = {"membership": dataclasses.asdict(m)}
            except Exception as exc:
                result = {"error": type(exc).__name__, "message": str(exc)}
            result.update(id=cmd["id"], elapsed=time.monotonic() - start)
            print("RESULT " + json.dumps(result), file=out, flush=True)

pairs = json.loads(sys.argv[1])
children = []
for mine in pairs:
    pid = os.fork()
    if pid == 0:
        try:
            for other in pairs:
                if other is not mine:
                    os.close(other[0]); os.close(other[1])
            serve(*mine)
        finally:
            os._exit(0)
    children.append(pid)
for fd_in, fd_out in pairs:
    os.close(fd_in); os.close(fd_out)
for pid in children:
    os.waitpid(pid, 0)
"""


class RankProcesses:
    """Rank processes that each run rendezvous on command; `stop` ends them all (their process group)."""

    def __init__(self, n: int, logdir: Path):
        self.log = logdir / "ranks.log"
        self.commands: list[IO[str]] = []
        self.lines: list[queue.Queue[str]] = []
        pairs, theirs = [], []
        for _ in range(n):
            cmd_r, cmd_w = os.pipe()
            res_r, res_w = os.pipe()
            pairs.append([cmd_r, res_w])
            theirs += [cmd_r, res_w]
            self.commands.append(os.fdopen(cmd_w, "w"))
            lines: queue.Queue[str] = queue.Queue()
            threading.Thread(target=self._read, args=(os.fdopen(res_r), lines), daemon=True).start()
            self.lines.append(lines)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
        try:
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(pairs)], cwd=ROOT, env=env,
                                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             pass_fds=theirs, start_new_session=True)
        finally:
            for fd in theirs:
                os.close(fd)
        deadline = time.monotonic() + 120
        for i in range(n):
            self._next(i, "READY", deadline)

    @staticmethod
    def _read(stream: IO[str], lines: queue.Queue[str]) -> None:
        with stream:
            for line in stream:
                lines.put(line.rstrip("\n"))
        lines.put("")  # EOF: the rank process exited

    def _next(self, i: int, prefix: str, deadline: float) -> str:
        while True:
            try:
                line = self.lines[i].get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"rank process {i} sent no {prefix} line in time; log:\n{self.tail()}") from None
            if not line:
                raise AssertionError(f"rank process {i} exited; log:\n{self.tail()}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def run(self, commands: dict[int, dict[str, Any]], wait_s: float) -> dict[int, dict[str, Any]]:
        """Send rank process i commands[i] (all at once) and return each one's result."""
        ids = {}
        for i, cmd in commands.items():
            ids[i] = uuid.uuid4().hex
            self.commands[i].write(json.dumps(dict(cmd, id=ids[i])) + "\n")
            self.commands[i].flush()
        deadline = time.monotonic() + wait_s
        results = {}
        for i in commands:
            while (result := json.loads(self._next(i, "RESULT ", deadline)))["id"] != ids[i]:
                pass  # a late answer to an earlier test's command
            results[i] = result
        return results

    def stop(self) -> None:
        for stream in self.commands:  # end of commands: each rank process exits, then the launcher
            stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        with contextlib.suppress(ProcessLookupError):  # what is left of the group we started (a stuck rank)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankProcesses]:
    procs: RankProcesses | None = None
    try:
        procs = RankProcesses(4, tmp_path_factory.mktemp("rendezvous"))
        yield procs
    finally:
        if procs is not None:
            procs.stop()


def commands(ranks: list[int], world_size: int, timeout_s: float, **per_rank: Any) -> dict[int, dict[str, Any]]:
    """Worker i plays rank ranks[i]; per_rank['uri'|'agreed'] maps a rank to its own value."""
    port, cluster = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    out = {}
    for i, rank in enumerate(ranks):
        out[i] = {"host": "127.0.0.1", "port": port, "rank": rank, "world_size": world_size,
                  "uri": per_rank.get("uri", {}).get(rank, f"tcp://127.0.0.1:{7100 + rank}"),
                  "agreed": per_rank.get("agreed", {}).get(rank, {"hash_seed": 1, "scheme": "zen"}),
                  "cluster_id": cluster, "timeout_s": timeout_s, "secret": SECRET.hex()}
    return out


# --- static membership ---------------------------------------------------------------------------


@pytest.mark.inprocess
def test_static_membership_is_validated_and_complete() -> None:
    m = static_membership(2, 4, PEERS, cluster_id="c1", agreed={"hash_seed": 1}, generation=3)
    assert m.peers == dict(enumerate(PEERS))
    assert (m.rank, m.world_size, m.generation, m.cluster_id, m.source) == (2, 4, 3, "c1", "static")
    assert m.agreed == {"hash_seed": 1, "protocol_version": PROTOCOL_VERSION}


@pytest.mark.inprocess
@pytest.mark.parametrize(("change", "expected"), [
    ({"world_size": 0, "peers": []}, "world_size=0"),
    ({"rank": 4}, "rank=4"),
    ({"rank": -1}, "rank=-1"),
    ({"peers": PEERS[:3]}, "peers has 3 URIs"),
    ({"peers": [PEERS[0], "http://10.0.0.2:7000", *PEERS[2:]]}, "peers[1]: transport URI 'http://10.0.0.2:7000'"),
    ({"peers": [*PEERS[:2], "tcp://10.0.0.3", PEERS[3]]}, "peers[2]: transport URI 'tcp://10.0.0.3'"),
    ({"peers": [*PEERS[:3], "tcp://10.0.0.4:0"]}, "peers[3] URI 'tcp://10.0.0.4:0' has port 0"),
    ({"peers": [*PEERS[:3], "ucx://10.0.0.1:7000"]}, "peers[0] and peers[3] both use data-plane address 10.0.0.1:7000"),
    ({"cluster_id": ""}, "cluster_id=''"),
    ({"generation": -1}, "generation=-1"),
    ({"agreed": {"when": object()}}, "agreed is not JSON-able"),
    ({"agreed": {3: "x"}}, "agreed has key 3"),
    ({"agreed": {"protocol_version": 99}}, "agreed has protocol_version=99"),
])
def test_static_membership_errors_name_the_value(change: dict[str, Any], expected: str) -> None:
    kwargs: dict[str, Any] = {"rank": 0, "world_size": 4, "peers": PEERS, "cluster_id": "c1", "agreed": {}}
    kwargs.update(change)
    with pytest.raises(MembershipError) as info:
        static_membership(kwargs.pop("rank"), kwargs.pop("world_size"), kwargs.pop("peers"), **kwargs)
    assert expected in str(info.value)


# --- torchrun's environment ----------------------------------------------------------------------

ENV = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "4", "GROUP_RANK": "3",
       "WORLD_SIZE": "16", "RANK": "13"}  # torchrun's, on node 3 of 4 with 4 trainers each


@pytest.mark.inprocess
def test_from_environment_reads_node_level_variables_and_a_port_of_its_own() -> None:
    assert from_environment(ENV) == ("10.0.0.1", 7001, 4, 3)  # not RANK/WORLD_SIZE (per process), not MASTER_PORT
    assert from_environment({**ENV, "ZEN_RENDEZVOUS_PORT": "7101", "ZEN_NODE_RANK": "1"}) == ("10.0.0.1", 7101, 4, 1)
    kubeflow = {"PET_MASTER_ADDR": "job-master-0", "PET_NNODES": "2", "PET_NODE_RANK": "1"}
    assert from_environment(kubeflow) == ("job-master-0", 7001, 2, 1)
    indexed_job = {"ZEN_RENDEZVOUS_ADDR": "job-0.svc", "ZEN_NUM_NODES": "8", "JOB_COMPLETION_INDEX": "5"}
    assert from_environment(indexed_job) == ("job-0.svc", 7001, 8, 5)


@pytest.mark.inprocess
@pytest.mark.parametrize(("change", "expected"), [
    ({"GROUP_RANK": None}, "ZEN_NODE_RANK / GROUP_RANK / NODE_RANK / PET_NODE_RANK / JOB_COMPLETION_INDEX (not set); "
                           "RANK and WORLD_SIZE are set, but under torchrun they count trainer processes"),
    ({"MASTER_ADDR": None, "GROUP_WORLD_SIZE": ""}, "ZEN_RENDEZVOUS_ADDR / MASTER_ADDR / PET_MASTER_ADDR; "
                                                    "ZEN_NUM_NODES / GROUP_WORLD_SIZE / NNODES / PET_NNODES (not set)"),
    ({"ZEN_RENDEZVOUS_PORT": "http"}, "ZEN_RENDEZVOUS_PORT='http' is not an integer"),
    ({"ZEN_RENDEZVOUS_PORT": "70000"}, "ZEN_RENDEZVOUS_PORT=70000"),
    ({"GROUP_WORLD_SIZE": "0"}, "GROUP_WORLD_SIZE=0"),
    ({"GROUP_RANK": "4"}, "GROUP_RANK=4 is outside [0, 4)"),
    ({"GROUP_RANK": "-1"}, "GROUP_RANK=-1"),
])
def test_from_environment_errors_name_the_variable(change: dict[str, str | None], expected: str) -> None:
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(MembershipError) as info:
        from_environment(env)
    assert expected in str(info.value)


# --- agreement and a one-rank rendezvous, in this process ----------------------------------------


@pytest.mark.inprocess
def test_check_agreement_names_key_rank_and_both_values() -> None:
    check_agreement({0: {"a": 1}, 1: {"a": 1}})
    with pytest.raises(MembershipError) as info:
        check_agreement({0: {"a": 1, "b": "x"}, 1: {"a": 1, "c": [1]}, 2: {"a": 2, "b": "x"}})
    message = str(info.value)
    assert 'rank 1 has no b but rank 0 has b="x"' in message
    assert "rank 1 has c=[1] but rank 0 has no c" in message
    assert "rank 2 has a=2 but rank 0 has a=1" in message


@pytest.mark.inprocess
def test_one_rank_rendezvous_hosts_and_closes_its_store() -> None:
    port = free_port()
    for _ in range(2):  # the port is free again: the store was closed, and a fresh one starts at 1
        m = rendezvous("127.0.0.1", port, 0, 1, "tcp://127.0.0.1:7000", cluster_id="solo",
                       agreed={"hash_seed": 1}, secret=SECRET, timeout_s=10)
        assert m.generation == 1
        assert m.peers == {0: "tcp://127.0.0.1:7000"}
        assert m.agreed == {"hash_seed": 1, "protocol_version": PROTOCOL_VERSION}
        assert m.source == f"rendezvous tcpstore://127.0.0.1:{port}"


@pytest.mark.inprocess
def test_rendezvous_checks_its_arguments_before_the_network() -> None:
    with pytest.raises(MembershipError, match="rank 1 my_uri: transport URI 'tcp://nowhere'"):
        rendezvous("127.0.0.1", 1, 1, 2, "tcp://nowhere", cluster_id="c", agreed={}, secret=SECRET)
    with pytest.raises(MembershipError, match="store_port=0"):
        rendezvous("127.0.0.1", 0, 1, 2, "tcp://h:1", cluster_id="c", agreed={}, secret=SECRET)
    with pytest.raises(MembershipError, match="timeout_s=0"):
        rendezvous("127.0.0.1", 1, 1, 2, "tcp://h:1", cluster_id="c", agreed={}, secret=SECRET, timeout_s=0)


# --- rendezvous across processes -----------------------------------------------------------------


@pytest.mark.daemon
def test_four_ranks_agree_on_peers_and_generation(ranks: RankProcesses) -> None:
    results = ranks.run(commands([0, 1, 2, 3], 4, timeout_s=20), wait_s=40)
    errors = {i: r["message"] for i, r in results.items() if "error" in r}
    assert not errors, errors
    views = [r["membership"] for r in results.values()]
    assert [v["rank"] for v in views] == [0, 1, 2, 3]
    expected_peers = {str(r): f"tcp://127.0.0.1:{7100 + r}" for r in range(4)}
    for view in views:
        assert view["peers"] == expected_peers
        assert view["generation"] == 1
        assert view["agreed"] == {"hash_seed": 1, "scheme": "zen", "protocol_version": PROTOCOL_VERSION}
        assert view["world_size"] == 4
        assert view["source"].startswith("rendezvous tcpstore://127.0.0.1:")


@pytest.mark.daemon
def test_settings_mismatch_is_refused_on_every_rank(ranks: RankProcesses) -> None:
    cmds = commands([0, 1, 2, 3], 4, timeout_s=20, agreed={2: {"hash_seed": 7, "scheme": "zen"}})
    results = ranks.run(cmds, wait_s=40)
    for i, result in results.items():
        assert result.get("error") == "MembershipError", (i, result)
        assert "rank 2 has hash_seed=7 but rank 0 has hash_seed=1" in result["message"], (i, result)


@pytest.mark.daemon
def test_duplicate_uri_is_refused(ranks: RankProcesses) -> None:
    uri = "tcp://127.0.0.1:7200"
    results = ranks.run(commands([0, 1], 2, timeout_s=20, uri={0: uri, 1: uri}), wait_s=40)
    for i, result in results.items():
        assert result.get("error") == "MembershipError", (i, result)
        assert "rank 0 and rank 1 both use data-plane address 127.0.0.1:7200" in result["message"], (i, result)


@pytest.mark.daemon
def test_missing_rank_times_out_naming_it(ranks: RankProcesses) -> None:
    timeout_s = 3.0
    results = ranks.run(commands([0, 1, 2], 4, timeout_s=timeout_s), wait_s=30)
    assert results[0]["error"] == RendezvousTimeoutError.__name__, results[0]
    for i, result in results.items():
        # ranks 1 and 2 time out too, or see rank 0 give up first; either way rank 3 is named
        assert result.get("error") in (RendezvousTimeoutError.__name__, "MembershipError"), (i, result)
        assert "rank 3 of world_size=4" in result["message"], (i, result)
        assert result["elapsed"] < timeout_s + 3, (i, result)


@pytest.mark.daemon
def test_missing_rank_0_times_out_naming_it(ranks: RankProcesses) -> None:
    timeout_s = 2.0
    result = ranks.run(commands([1], 2, timeout_s=timeout_s), wait_s=30)[0]
    assert result.get("error") == RendezvousTimeoutError.__name__, result
    assert "rank 0 is missing" in result["message"]
    assert result["elapsed"] < timeout_s + 2, result


@pytest.mark.daemon
def test_two_processes_claiming_one_rank_are_refused(ranks: RankProcesses) -> None:
    results = ranks.run(commands([0, 1, 1], 3, timeout_s=2.0), wait_s=30)
    taken = [r for r in results.values() if "rank 1 is already taken" in r.get("message", "")]
    assert len(taken) == 1, results
    assert all("error" in r for r in results.values()), results  # rank 2 never came: the rest time out


@pytest.mark.daemon
def test_rank_auto_the_store_host_is_0_the_others_take_the_free_ranks(ranks: RankProcesses) -> None:
    """Four daemons with --rank auto for three places: the one that hosts the store is rank 0, two
    take 1 and 2, and the one too many is refused with the reason, not given a rank twice."""
    cmds = commands([AUTO_RANK] * 4, 3, timeout_s=20)
    for i, cmd in cmds.items():
        cmd["uri"] = f"tcp://127.0.0.1:{7200 + i}"
    results = ranks.run(cmds, wait_s=40)
    refused = {i: r["message"] for i, r in results.items() if "error" in r}
    assert len(refused) == 1 and "every rank of world_size=3 is taken" in next(iter(refused.values())), refused
    views = [r["membership"] for i, r in results.items() if i not in refused]
    assert sorted(v["rank"] for v in views) == [0, 1, 2]
    assert all(v["peers"] == views[0]["peers"] for v in views)
    mine = {v["rank"]: cmds[i]["uri"] for i, v in zip([i for i in results if i not in refused], views, strict=True)}
    assert {int(r): u for r, u in views[0]["peers"].items()} == mine
