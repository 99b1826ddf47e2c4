"""The first hour: `zend launch` on one machine with nothing set beforehand, Ctrl-C, a failing job,
a client that waits for its daemon, and a trainer's import that carries no daemon."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zen

from tests.subprocess_env import project_path
from zend.cluster.local import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests/cluster/launched_script.py")
ZEN_VARIABLES = ("ZEN_SOCKET_DIR", "ZEN_JOB", "ZEN_JOB_TOKEN", "ZEN_CLUSTER_SECRET", "ZEN_CLUSTER_SECRET_FILE")


@pytest.fixture
def xdg() -> Iterator[Path]:
    """A private runtime folder with a short path, like /run/user/UID (unix sockets live under it)."""
    folder = Path(tempfile.mkdtemp(prefix="xdg-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _user_env(runtime_dir: Path) -> dict[str, str]:
    """A new user's shell: none of zen's variables, a private runtime folder."""
    env = {k: v for k, v in os.environ.items() if k not in ZEN_VARIABLES}
    return {**env, "XDG_RUNTIME_DIR": str(runtime_dir), "PYTHONPATH": project_path()}


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """`zend launch` as from a terminal: SIGINT at its default (a shell's background job, such as a CI
    runner's, starts its children with SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    return subprocess.Popen([sys.executable, "-m", "zend", "launch", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stop(proc: subprocess.Popen[str], xdg: Path) -> None:
    """A launcher a test gave up on: SIGTERM (it stops what it started), then SIGKILL, then whatever of its
    run (daemons and agents are in sessions of their own) still names its folder."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    subprocess.run(["pkill", "-KILL", "-f", str(xdg)], check=False)


def _left_running(job: str) -> str:
    return subprocess.run(["pgrep", "-af", job], capture_output=True, text=True).stdout.strip()


@pytest.mark.daemon
def test_launch_runs_two_nodes_of_two_trainers_with_nothing_set(xdg: Path) -> None:
    env = _user_env(xdg)
    proc = _launch(["--nodes", "2", "--trainers", "2", "--job", "firsthour-ok", "--", SCRIPT, "3"], env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"rank (\d) of 4: ok, job firsthour-ok", out)) == ["0", "1", "2", "3"], out
    assert os.listdir(xdg) == []  # the run folder (sockets, logs, the secret) is gone
    assert _left_running("firsthour-ok") == ""


@pytest.mark.daemon
def test_launch_restarts_a_job_whose_trainer_died_and_its_steps_go_on_where_the_daemons_are(xdg: Path) -> None:
    """--max-restarts: the last rank dies before step 2; torchrun restarts both nodes' trainers (c10d), whose
    process groups form on a store of their own life (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) and whose zen steps
    start where the daemons are, not at 0, which the daemons had synchronised already. The step the dead life
    left running was aborted on both nodes; the new life redoes it as its next attempt on both."""
    env = _user_env(xdg)
    proc = _launch(["--nodes", "2", "--trainers", "1", "--max-restarts", "1", "--job", "firsthour-restart", "--",
                    SCRIPT, "3", "die-once"], env)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        _stop(proc, xdg)
    assert proc.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"rank (\d) of 2: ok, job firsthour-restart", out)) == ["0", "1"], out
    assert _left_running("firsthour-restart") == ""


@pytest.mark.daemon  # a subprocess (it starts nothing)
def test_launch_refuses_restarts_with_static_node_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "zend", "launch", "--nnodes", "2", "--node-rank", "0",
                           "--master-addr", "127.0.0.1", "--max-restarts", "1", "--", SCRIPT, "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--max-restarts 1 with --node-rank 0" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.daemon
def test_launch_ctrl_c_midway_leaves_nothing_behind(xdg: Path) -> None:
    env = _user_env(xdg)
    shm_before = set(os.listdir("/dev/shm"))
    proc = _launch(["--nodes", "2", "--trainers", "2", "--job", "firsthour-int", "--", SCRIPT, "1", "sleep"], env)
    try:
        deadline = time.monotonic() + 240
        runs = []
        while time.monotonic() < deadline and proc.poll() is None:
            runs = os.listdir(xdg)
            if runs and len(list((xdg / runs[0]).glob("node*.log"))) == 2 \
                    and "sleep" in _left_running("launched_script.py 1 sleep"):
                break
            time.sleep(0.2)
        assert runs, "the run folder was never made under $XDG_RUNTIME_DIR"
        secret = xdg / runs[0] / "cluster.secret"
        assert secret.stat().st_mode & 0o077 == 0  # the run's own secret: the user's only
        time.sleep(3)  # midway: the trainers are past their first step
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)  # the stop of two nodes, their agents and ranks (SIGTERM, then 10 s)
    finally:
        _stop(proc, xdg)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert os.listdir(xdg) == []
    assert _left_running("firsthour-int") == "" and _left_running("launched_script.py 1 sleep") == ""
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.daemon
def test_launch_keeps_the_daemons_logs_when_the_job_fails(xdg: Path) -> None:
    env = _user_env(xdg)
    proc = _launch(["--nodes", "2", "--trainers", "2", "--job", "firsthour-fail", "--", SCRIPT, "1", "fail"], env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    found = re.search(r"the daemons' logs are in (\S+)", err)
    assert found, err[-3000:]
    kept = Path(found.group(1))
    try:
        assert sorted(p.name for p in kept.iterdir()) == ["node0.log", "node1.log"]
        assert "daemon stopped" in (kept / "node0.log").read_text()  # whole: kept after the daemon stopped
    finally:
        shutil.rmtree(kept)
    assert os.listdir(xdg) == []  # the secret and the sockets went with the run folder
    assert _left_running("firsthour-fail") == ""


@pytest.mark.daemon
def test_a_client_waits_for_a_daemon_that_is_still_joining(tmp_path: Path) -> None:
    """`zend serve & python train.py`: node 0 is up but waits for node 1; the client waits with it."""
    cluster = LocalCluster(2, tmp_path)
    got: dict[str, object] = {}

    def connect() -> None:
        try:
            got["client"] = zen.Client(cluster.socket_dir(0), job="j", token=cluster.token("j"), wait_s=120)
        except Exception as exc:
            got["error"] = exc

    try:
        cluster.start_node(0)
        waiter = threading.Thread(target=connect)
        waiter.start()
        time.sleep(3)
        assert waiter.is_alive() and not got, got  # still waiting: node 0 joins until node 1 comes
        cluster.start_node(1)
        waiter.join(120)
        assert "client" in got, got
        client = got["client"]
        assert isinstance(client, zen.Client) and client.world_size == 2
        client.close()
    finally:
        cluster.close()


@pytest.mark.inprocess
def test_a_client_that_may_not_wait_fails_at_once_naming_the_socket(tmp_path: Path) -> None:
    t = time.monotonic()
    with pytest.raises(zen.DaemonUnavailable, match=f"no zend daemon at unix:{tmp_path}/zend.sock"):
        zen.Client(str(tmp_path), job="j", token="t", wait_s=0)
    with pytest.raises(zen.DaemonUnavailable, match=r"waited 1 s"):
        zen.Client(str(tmp_path), job="j", token="t", wait_s=1)
    assert time.monotonic() - t < 10


@pytest.mark.daemon
def test_import_zen_loads_no_daemon_code() -> None:
    code = ("import sys, zen\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite', 'cryptography', "
            "'prometheus_client') or m.startswith(('zend.daemon', 'zend.core.schemes', 'zend.core.kernels', "
            "'zend.buffers.buffer_server', 'zend.transport', 'zend.simulator')))\n"
            "print(bad)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": project_path()})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


@pytest.mark.inprocess
def test_zen_errors_are_torch_dist_errors() -> None:
    import torch.distributed as dist

    for cls in (zen.StepAborted, zen.StepTimeout, zen.DaemonUnavailable, zen.InvalidGradient, zen.OutOfOrder):
        assert issubclass(cls, dist.DistError), cls
    assert issubclass(zen.DaemonUnavailable, dist.DistNetworkError)


@pytest.mark.daemon
def test_torchrun_c10d_rendezvous_beside_daemons_that_take_their_rank_from_zends(tmp_path: Path) -> None:
    """No node rank anywhere: the daemons get theirs from zend's rendezvous (--rank auto), the
    trainers theirs from torchrun's c10d rendezvous; every sum is still right."""
    from zend.cluster.local import free_port
    from zend.daemon.jobs import job_token
    from zend.daemon.secret import decode, new_secret

    secret_file = tmp_path / "cluster.secret"
    text = new_secret()
    secret_file.write_text(text)
    secret_file.chmod(0o600)
    env = {**os.environ, "ZEN_CLUSTER_SECRET_FILE": str(secret_file), "PYTHONPATH": project_path()}
    store = free_port()
    daemons, agents = [], []
    try:
        for i in range(2):
            log = open(tmp_path / f"node{i}.log", "wb")  # noqa: SIM115 (the child owns it)
            daemons.append(subprocess.Popen(
                [sys.executable, "-m", "zend", "serve", "--rank", "auto", "--world-size", "2", "--rendezvous",
                 f"127.0.0.1:{store}", "--listen", f"tcp://127.0.0.1:{free_port()}", "--socket-dir",
                 str(tmp_path / f"node{i}"), "--metrics-port", "0", "--log-format", "text"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        ranks = set()
        for i in range(2):
            deadline = time.monotonic() + 120
            while True:
                status = subprocess.run([sys.executable, "-m", "zend", "status", "--socket-dir",
                                         str(tmp_path / f"node{i}")], env=env, capture_output=True, text=True)
                found = re.search(r"node (\d) of 2", status.stdout)
                if status.returncode == 0 and found and "serving" in status.stdout:
                    ranks.add(found.group(1))
                    break
                assert time.monotonic() < deadline and daemons[i].poll() is None, \
                    (tmp_path / f"node{i}.log").read_text()[-3000:]
                time.sleep(0.3)
        assert ranks == {"0", "1"}
        rdzv = free_port()
        token = job_token(decode(text.encode(), "test"), "c10d")
        for i in range(2):
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}", "--rdzv-id=c10d", "--max-restarts=0",
                 "--monitor-interval=0.2", SCRIPT, "2"],
                env={**env, "ZEN_SOCKET_DIR": str(tmp_path / f"node{i}"), "ZEN_JOB": "c10d", "ZEN_JOB_TOKEN": token,
                     "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
        outs = []
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            assert agent.returncode == 0, err[-3000:]
            outs.append(out)
        assert sorted(re.findall(r"rank (\d) of 4: ok", "".join(outs))) == ["0", "1", "2", "3"], outs
    finally:
        for proc in [*agents, *daemons]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in [*agents, *daemons]:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.daemon
def test_launch_one_node_of_many_without_node_ranks(tmp_path: Path, xdg: Path) -> None:
    """Two `zend launch --nnodes 2` (two hosts' worth, here on loopback), no --node-rank: each starts
    its node's daemon (--rank auto), waits, runs torchrun with its c10d rendezvous, and cleans up."""
    from zend.cluster.local import free_port
    from zend.daemon.secret import new_secret

    secret_file = tmp_path / "cluster.secret"
    secret_file.write_text(new_secret())
    secret_file.chmod(0o600)
    # zend serve's other settings come from ZEND_* variables: two daemons on one host need two metrics ports
    env = {**_user_env(xdg), "ZEN_CLUSTER_SECRET_FILE": str(secret_file), "ZEND_METRICS_PORT": "0"}
    common = ["--nnodes", "2", "--trainers", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
              "--rendezvous-port", str(free_port()), "--job", "firsthour-nodes"]
    procs = [_launch([*common, "--listen", f"tcp://127.0.0.1:{free_port()}", "--", SCRIPT, "2"], env)
             for _ in range(2)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for proc in procs:
            _stop(proc, xdg)
    assert sorted(re.findall(r"rank (\d) of 4: ok, job firsthour-nodes", "".join(outs))) == ["0", "1", "2", "3"]
    assert os.listdir(xdg) == []
    assert _left_running("firsthour-nodes") == ""
