"""The `zend` command as an operator meets it: quick to answer, plain errors, readable output.

Start-up: `zend --help`, `--version` and `token` must not import torch and the rest (they took
seconds); benchmarks/cli_startup.py times them, these tests only check what gets imported.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_all
from zend.api.zen.v1 import zen_pb2 as pb
from zend.cluster.command import steps_as_they_complete
from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.daemon.commands import format_status, message_dict
from zend.daemon.membership import ADDRESS_VARIABLES, NODE_COUNT_VARIABLES, NODE_RANK_VARIABLES, PORT_VARIABLE
from zend.daemon.secret import SECRET_ENV, SECRET_FILE_ENV
from zend.protocol.session import TrainerSession
from zend.transport.engine_choice import choose_engine

HEAVY_MODULES = ("torch", "numpy", "numba", "grpc", "google.protobuf", "zend.api.zen.v1.zen_pb2")
SECRET = "cli-ergonomics-test-secret"


def zend(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zend", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def env_without(*names: str, **extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in names}, **extra}


# ---------------------------------------------------------------------------------------- start-up

IMPORTED_AFTER_MAIN = """
import contextlib, io, json, os, sys
from zend import cli
out = io.StringIO()
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):
    cli.main(sys.argv[1:])
heavy = [m for m in os.environ["HEAVY_MODULES"].split(",") if m in sys.modules]
print(json.dumps({"out": out.getvalue(), "heavy": heavy}))
"""


@pytest.mark.daemon
@pytest.mark.parametrize("argv, expect", [
    (["--help"], "{simulate,serve,status,health,store,secret,token,cluster,launch}"),
    (["--version"], "zend "),
    (["token", "--job", "j"], ""),
    (["token", "--operator"], ""),
])
def test_help_version_and_token_import_no_torch_numpy_numba_or_grpc(argv, expect):
    env = env_without(SECRET_FILE_ENV, **{SECRET_ENV: SECRET, "HEAVY_MODULES": ",".join(HEAVY_MODULES)})
    run = subprocess.run([sys.executable, "-c", IMPORTED_AFTER_MAIN, *argv], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["heavy"] == [], f"`zend {' '.join(argv)}` imported {result['heavy']}"
    assert expect in result["out"]
    if argv[0] == "token":  # and it is still the real token
        from zend.daemon.jobs import job_token, operator_token

        want = operator_token(SECRET.encode()) if "--operator" in argv else job_token(SECRET.encode(), "j")
        assert result["out"].strip() == want and len(want) == 64
        assert operator_token(SECRET.encode()) != job_token(SECRET.encode(), "")  # another label, not a job's


# ---------------------------------------------------------------------------------------- token

@pytest.mark.daemon
@pytest.mark.parametrize("secret_env", [None, ""])
def test_token_without_a_secret_says_none_is_set_and_how_to_set_one(secret_env):
    env = env_without(SECRET_ENV, SECRET_FILE_ENV, **({SECRET_ENV: secret_env} if secret_env is not None else {}))
    run = zend("token", "--job", "j", env=env)
    assert run.returncode == 2 and run.stdout == ""
    assert "no cluster secret is set" in run.stderr
    for way in ("--secret-file", f"${SECRET_FILE_ENV}", f"${SECRET_ENV}"):
        assert way in run.stderr
    assert "0 bytes" not in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.daemon
def test_token_with_a_short_secret_still_says_how_short(tmp_path):
    (tmp_path / "secret").write_text("short\n")
    run = zend("token", "--job", "j", "--secret-file", str(tmp_path / "secret"), env=env_without(SECRET_ENV))
    assert run.returncode == 2 and "is 5 bytes; at least 16 are required" in run.stderr, run.stderr


# ---------------------------------------------------------------------------------------- status

@pytest.mark.daemon
def test_status_table_and_json_from_live_daemons(tmp_path):
    """Two nodes, one trainer each with a registered tensor that has synchronised one step: the table
    shows the node, its peer, the sessions and the tensor; --json the same with real numbers. --drain and
    --undrain too. All with the cluster secret (the operator token); without it the view is redacted."""
    with LocalCluster(2, tmp_path, metrics=False, extra=["--log-format", "text"]) as c:
        def trainer(node: int) -> tuple[str, str]:
            with TrainerSession(c.socket_dir(node), "jobA", c.token("jobA"), 0, 1, timeout_s=60) as link:
                h = link.register("wte", (40, 3))
                link.allreduce(h, SparseGrad(torch.tensor([1, 7]), torch.ones(2, 3), 40), 4)
                if node == 1:
                    return "", ""
                # while the session is open, so that it shows
                return (zend("status", "--socket-dir", c.socket_dir(0), env=c.env).stdout,
                        zend("status", "--json", "--socket-dir", c.socket_dir(0), env=c.env).stdout,
                        zend("status", "--socket-dir", c.socket_dir(0), env=no_secret))

        no_secret = env_without(SECRET_ENV, SECRET_FILE_ENV)
        results = run_all([lambda: trainer(0), lambda: trainer(1)], timeout_s=180)
        assert not any(isinstance(r, BaseException) for r in results), results
        table, as_json, redacted = results[0]
        refused = zend("status", "--drain", "5", "--socket-dir", c.socket_dir(1), env=no_secret)
        assert refused.returncode == 2 and "--drain needs the operator token" in refused.stderr, refused.stderr
        assert zend("health", "--socket-dir", c.socket_dir(1)).returncode == 0  # not drained
        drained = zend("status", "--drain", "5", "--socket-dir", c.socket_dir(1), env=c.env)
        assert drained.returncode == 0 and drained.stdout.endswith("drained: 0 steps completed, 0 abandoned\n")
        drained = zend("status", "--drain", "5", "--json", "--socket-dir", c.socket_dir(1), env=c.env)
        assert json.loads(drained.stdout) == {"completed": 0, "abandoned": 0}
        assert zend("health", "--socket-dir", c.socket_dir(1)).returncode == 1  # NOT_SERVING
        undrained = zend("status", "--undrain", "--socket-dir", c.socket_dir(1), env=c.env)
        assert undrained.returncode == 0 and undrained.stdout.endswith("undrained: serving\n"), undrained.stderr
        assert zend("health", "--socket-dir", c.socket_dir(1)).returncode == 0
    # without the secret: node-level fields only, and a line on stderr saying so
    assert redacted.returncode == 0 and "redacted view" in redacted.stderr and "--secret-file" in redacted.stderr
    assert redacted.stdout.startswith("node 0 of 2, generation 0") and "jobA" not in redacted.stdout
    assert "wte" not in redacted.stdout and c.peers[1] not in redacted.stdout
    assert "sessions: 1; tensors: 1 (redacted" in redacted.stdout
    assert table.startswith("node 0 of 2, generation 0, cluster 'zen', zend "), table
    engine = choose_engine("auto", "tcp")[0]  # the daemons' default: native wherever the engine was built
    assert f"membership static; transport tcp ({engine} engine);" in table
    peers = table.split("peers (1):\n")[1].splitlines()
    assert peers[0].split() == ["rank", "address", "state"]
    assert peers[1].split() == ["1", c.peers[1], "connected"]
    sessions = table.split("sessions (1):\n")[1].splitlines()
    assert sessions[1].split()[1:3] == ["jobA", "0"]
    tensors = table.split("tensors (1):\n")[1].splitlines()
    assert tensors[0].split()[:9] == ["job", "tensor", "id", "shape", "dtype", "layout", "scheme", "steps", "last"]
    cells = tensors[1].split()
    assert cells[:2] == ["jobA", "wte"] and cells[3:6] == ["40x3", "float32", "sparse_rows"]
    assert cells[7:9] == ["1", "4"]  # one step so far, and it was step 4
    assert "{" not in table and '"' not in table

    status = json.loads(as_json)
    assert (status["node_rank"], status["node_count"], status["generation"]) == (0, 2, 0)
    assert status["peers"] == [{"rank": 1, "address": c.peers[1], "connected": True, "error": ""}]
    tensor = status["tensors"][0]
    assert (tensor["shape"], tensor["steps"], tensor["last_step"], tensor["dtype"]) == ([40, 3], 1, 4, "FLOAT32")
    assert isinstance(tensor["last_nnz_in"], int) and tensor["last_nnz_in"] == 2
    assert isinstance(status["buffer_pool_bytes"], int) and status["buffer_pool_bytes"] > 0
    assert status["sessions"][0]["job_id"] == "jobA" and isinstance(status["sessions"][0]["pid"], int)


@pytest.mark.inprocess
def test_status_table_names_a_down_peer_and_leaves_unrun_steps_blank():
    reply = pb.StatusReply(node_rank=1, node_count=3, generation=2, cluster_id="c", membership="elastic x",
                           transport="ucx", ucx_transports=["rc", "cuda_copy"], draining=True,
                           peers=[pb.PeerStatus(rank=0, address="ucx://a:7000", connected=True),
                                  pb.PeerStatus(rank=2, address="ucx://b:7000", error="no heartbeat for 5 s")],
                           tensors=[pb.TensorStatus(job_id="j", name="emb", shape=[8, 2], dtype=pb.BFLOAT16,
                                                    layout=pb.DENSE, scheme="auto")],
                           last_membership_change="node 2 lost", last_membership_change_unix=1.7e9)
    table = format_status(reply)
    assert "node 1 of 3, generation 2" in table and "DRAINING" in table and "transport ucx (rc, cuda_copy)" in table
    assert ": node 2 lost" in table and "sessions (0): none" in table
    assert "ucx://b:7000  down: no heartbeat for 5 s" in table
    assert table.splitlines()[-1].split() == ["j", "emb", "0", "8x2", "bfloat16", "dense", "auto", "0", *["-"] * 6]
    as_dict = message_dict(reply)
    assert as_dict["generation"] == 2 and as_dict["tensors"][0]["layout"] == "DENSE"
    assert as_dict["ucx_transports"] == ["rc", "cuda_copy"] and as_dict["sessions"] == []


# ---------------------------------------------------------------------------------------- cluster

@pytest.mark.daemon
def test_cluster_rejects_an_unknown_scheme_in_one_line():
    run = zend("cluster", "--scheme", "bogus", "--nodes", "1")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert "--scheme" in error and "'bogus'" in error and "'zen'" in error and "'auto'" in error, error


FAKE_TRAINER = """
import json, sys
for step in range(2):
    print(json.dumps({"node": int(sys.argv[1]), "local_rank": 0, "step": step, "ok": True}), flush=True)
    sys.stdin.readline()  # the test lets it go on
"""


@pytest.mark.daemon
def test_cluster_rows_come_as_each_step_completes():
    """Step 0's row is out while the trainers still wait to do step 1, not once they all exited."""
    procs = [subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, str(node)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for node in range(2)]
    try:
        steps = steps_as_they_complete(procs, stall_timeout_s=60)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(next, steps).result(timeout=60)
            assert [(r["step"], r["node"]) for r in sorted(first, key=lambda r: r["node"])] == [(0, 0), (0, 1)]
            assert all(p.poll() is None for p in procs)
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("\n")
                p.stdin.close()
            rest = pool.submit(list, steps).result(timeout=60)
        assert [sorted(r["node"] for r in step) for step in rest] == [[0, 1]]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _zend_cluster_in(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    tmp_path.mkdir()  # else tempfile falls back to /tmp
    run = zend("cluster", "--nodes", "1", "--trainers", "1", "--steps", "2", "--dim", "8", timeout=300,
               env={**os.environ, "TMPDIR": str(tmp_path), **env})
    return run, list(tmp_path.glob("zend-cluster-*"))


@pytest.mark.daemon
def test_cluster_removes_its_temporary_folder_only_after_a_clean_run_and_says_so(tmp_path):
    run, left = _zend_cluster_in(tmp_path / "ok")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "(removed after a clean run, kept if anything fails)" in run.stdout and "kept in" not in run.stdout
    assert [line.split()[0] for line in run.stdout.splitlines()[2:4]] == ["0", "1"]  # the table's rows
    assert left == []

    run, left = _zend_cluster_in(tmp_path / "bad", ZEND_CONFIG=str(tmp_path / "missing.toml"))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "zend cluster: zend node 0 exited with 2" in run.stderr and "missing.toml" in run.stderr
    assert len(left) == 1 and f"logs kept in {left[0]}" in run.stdout
    assert "missing.toml" in (left[0] / "node0.log").read_text()


# ---------------------------------------------------------------------------------------- serve

RENDEZVOUS_VARIABLES = (*ADDRESS_VARIABLES, *NODE_RANK_VARIABLES, *NODE_COUNT_VARIABLES, PORT_VARIABLE)


@pytest.mark.daemon
@pytest.mark.parametrize("given, missing", [
    ({}, ["MASTER_ADDR", "GROUP_RANK", "GROUP_WORLD_SIZE"]),
    ({"MASTER_ADDR": "127.0.0.1", "GROUP_RANK": "0"}, ["GROUP_WORLD_SIZE", "NNODES"]),
])
def test_serve_rendezvous_env_names_what_is_missing_before_making_its_socket_folder(tmp_path, given, missing):
    socket_dir = tmp_path / "run" / "zend"
    env = env_without(*RENDEZVOUS_VARIABLES, SECRET_FILE_ENV, **{SECRET_ENV: SECRET, **given})
    run = zend("serve", "--rendezvous", "env", "--listen", "tcp://127.0.0.1:0", "--socket-dir", str(socket_dir),
               "--metrics-port", "0", env=env, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert all(name in run.stderr for name in missing), run.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.inprocess
def test_status_of_a_node_with_20000_tensors_stays_within_the_cli_reply_limit():
    from zend.daemon.jobs import TensorStats
    from zend.daemon.operator_service import MAX_STATUS_ROWS, status_reply
    from zend.daemon.status import NodeStatus, SessionStatus, TensorStatus

    tensors = tuple(TensorStatus(f"job{i % 7}", "t" * 200 + str(i), i, (50_257, 768, 1, 1, 1, 1, 1, 1), "float32",
                                 "sparse_rows", "zen", TensorStats(steps=1)) for i in range(20_000))
    sessions = tuple(SessionStatus(f"{i:08x}", f"job{i % 7}", i % 1024, 1000 + i, 1 << 20) for i in range(5_000))
    node = NodeStatus(0, 2, 0, "c", "static", "tcp", (), 0, False, "0.1.0", 0, (), sessions, tensors)
    reply = status_reply(node)
    assert reply.ByteSize() < 4 << 20  # zend status's own reply limit
    assert (reply.tensor_count, len(reply.tensors), reply.session_count, len(reply.sessions)) == (
        20_000, MAX_STATUS_ROWS, 5_000, MAX_STATUS_ROWS)
    table = format_status(reply)
    assert f"tensors ({MAX_STATUS_ROWS} of 20000 shown)" in table
    assert f"sessions ({MAX_STATUS_ROWS} of 5000 shown)" in table


@pytest.mark.daemon
def test_zend_secret_makes_a_random_secret_that_every_command_reads_and_no_weakness_is_logged(tmp_path):
    from zend.daemon.jobs import job_token
    from zend.daemon.secret import decode

    printed = zend("secret", env=env_without(SECRET_ENV, SECRET_FILE_ENV))
    assert printed.returncode == 0, printed.stderr
    text = printed.stdout.strip()
    assert text.startswith("zen1.") and len(decode(text.encode(), "test")) == 32
    assert zend("secret").stdout.strip() != text  # random each time
    path = tmp_path / "secret"
    assert zend("secret", "--out", str(path)).returncode == 0
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = zend("secret", "--out", str(path))
    assert again.returncode == 2 and "cannot create" in again.stderr  # never overwrites a secret
    token = zend("token", "--job", "j", env=env_without(SECRET_ENV, **{SECRET_FILE_ENV: str(path)}))
    assert token.returncode == 0 and "weak" not in token.stderr, token.stderr
    assert token.stdout.strip() == job_token(decode(path.read_bytes().strip(), "test"), "j")


@pytest.mark.daemon
def test_a_printable_passphrase_is_logged_as_weak_and_still_works() -> None:
    """A 23-character dictionary secret fell to an offline guess in 0.06 s (issue 32)."""
    weak = zend("token", "--job", "j", env=env_without(SECRET_FILE_ENV, **{SECRET_ENV: "correct horse battery staple"}))
    assert weak.returncode == 0 and len(weak.stdout.strip()) == 64
    assert "weak cluster secret" in weak.stderr, weak.stderr
