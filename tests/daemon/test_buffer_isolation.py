"""Issue 14, item 7: a job's buffers are its own. Real daemons, real trainers, attackers in processes.

A claim on buffers.sock needs the session's job token as well as its id; the daemon's memfds are
0600 and the daemon is non-dumpable, so a process of the same uid (another job's trainer) cannot
open a job's in-flight buffer through /proc/<zend pid>/fd/N.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zend.protocol.session as session_module
from tests.helpers import run_all
from tests.subprocess_env import project_path
from zend.buffers import BufferClient, SharedBufferError, wire
from zend.cluster.local import LocalCluster
from zend.core.sparse import SparseGrad
from zend.protocol.session import TrainerSession

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534  # the daemon, its honest trainer and the attacker all run as this uid in the /proc test
ROWS, DIM = 40, 4


def grad(step: int, rank: int) -> SparseGrad:
    """Trainer `rank`'s gradient at `step`: a few rows, some of them shared with the other trainer."""
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, ROWS, (12,), generator=g)
    return SparseGrad(idx, torch.randn(12, DIM, generator=g), ROWS)


def reference(step: int) -> torch.Tensor:
    return grad(step, 0).to_dense() + grad(step, 1).to_dense()


def intrude(path: str, session_id: str, other_jobs_token: str) -> list[str]:
    """Every way to claim `session_id` without its token; the daemon's answers (each must be a refusal)."""
    answers = []
    for token in (other_jobs_token, "0" * 64):
        try:
            BufferClient(path, session_id, token, timeout_s=10).close()
            answers.append("claimed")
        except SharedBufferError as exc:
            answers.append(str(exc))
    with socket.socket(socket.AF_UNIX) as s:  # no token at all
        s.settimeout(10)
        s.connect(path)
        wire.send_message(s, {"op": "hello", "session": session_id})
        answers.append(str(wire.recv_message(s).body.get("error")))
    return answers


def test_a_claim_with_the_session_id_but_not_its_token_is_refused_and_its_trainer_still_claims_it(
        fresh_cluster: Callable[..., LocalCluster], monkeypatch: pytest.MonkeyPatch) -> None:
    """Between each trainer's OpenSession and its claim, another job's process that learnt the session id
    tries to claim it (its own job's token, a made-up one, none): refused; the trainers then claim their
    sessions and get the right sums."""
    c = fresh_cluster(1, extra=["--log-format", "text"])
    real_client = session_module.BufferClient
    attempts: list[list[str]] = []

    def intruder_first(path: str, session_id: str, token: str, **kwargs: Any) -> BufferClient:
        if not kwargs.get("attach"):  # the session is open and not yet claimed: the window of the attack
            attempts.append(intrude(path, session_id, c.token("intruder")))
        return real_client(path, session_id, token, **kwargs)

    monkeypatch.setattr(session_module, "BufferClient", intruder_first)

    def trainer(rank: int) -> list[torch.Tensor]:
        with TrainerSession(c.socket_dir(0), "victim", c.token("victim"), rank, 2, timeout_s=30) as link:
            h = link.register("emb", (ROWS, DIM))
            return [link.allreduce(h, grad(step, rank), step).to_dense() for step in range(2)]

    results = run_all([lambda r=r: trainer(r) for r in range(2)])
    for got in results:
        assert not isinstance(got, BaseException), got
        for step in range(2):
            torch.testing.assert_close(got[step], reference(step))
    assert len(attempts) == 2
    for answers in attempts:
        assert answers[0].endswith("refused: the token given is not the token of the session's job"), answers
        assert answers[1].endswith("refused: the token given is not the token of the session's job"), answers
        assert "missing field 'token'" in answers[2], answers
    assert "the token given is not the token of the session's job" in c.log_path(0).read_text()


# -- a same-uid process of another job and /proc/<zend pid>/fd -----------------------------------

class _AsNobody(LocalCluster):
    """Daemons that run as uid/gid 65534, no supplementary groups."""

    def argv(self, node: int) -> list[str]:
        return as_nobody(super().argv(node))


def as_nobody(argv: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


@pytest.fixture
def nobody_dir() -> Iterator[Path]:
    """A folder uid 65534 owns (pytest's tmp_path is root's, 0700), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the daemon and the attacker as another uid (65534); a test run as "
                    "root itself would pass every ptrace check and prove nothing")
    path = Path(tempfile.mkdtemp(prefix="zend-nobody-"))
    try:
        os.chown(path, NOBODY, NOBODY)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spawned() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start processes as uid 65534; each is killed at teardown, also when the test failed."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(code: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(as_nobody([sys.executable, "-c", code, *args]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(ValueError, OSError):
            proc.communicate(timeout=30)


HONEST_TRAINER = """
import json, sys, threading
from tests.daemon.test_buffer_isolation import grad, ROWS, DIM
from zend.protocol.session import TrainerSession

links = [TrainerSession(sys.argv[1], "victim", sys.argv[2], rank, 2, timeout_s=30) for rank in range(2)]
handles = [link.register("emb", (ROWS, DIM)) for link in links]

def step(n):
    out = [None, None]
    def run(rank):
        out[rank] = links[rank].allreduce(handles[rank], grad(n, rank), n).to_dense().tolist()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"step": n, "sums": out}), flush=True)

step(0)          # its buffers are in the daemon now, with a step's data in them
sys.stdin.readline()
step(1)          # after the attack
for link in links: link.close()
"""

ATTACKER = """
import json, os, sys
pid, fds = sys.argv[1], json.loads(sys.argv[2])
def attempt(path, flags):
    try:
        os.close(os.open(path, flags))
        return "opened"
    except OSError as exc:
        return type(exc).__name__
out = {"uid": os.getuid()}
try:
    out["listdir"] = len(os.listdir(f"/proc/{pid}/fd"))
except OSError as exc:
    out["listdir"] = type(exc).__name__
for n in fds:
    for name, flags in (("rw", os.O_RDWR), ("ro", os.O_RDONLY)):
        out[f"fd/{n} {name}"] = attempt(f"/proc/{pid}/fd/{n}", flags)
out["mem"] = attempt(f"/proc/{pid}/mem", os.O_RDONLY)
out["control"] = attempt(sys.argv[3], os.O_RDWR) if len(sys.argv) > 3 else "none"
print(json.dumps(out), flush=True)
"""

CONTROL = """
import os, sys
fd = os.memfd_create("control")
os.fchmod(fd, 0o600)
print(f"/proc/{os.getpid()}/fd/{fd}", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(240)
def test_a_same_uid_process_of_another_job_cannot_open_a_jobs_buffer_through_proc(
        nobody_dir: Path, spawned: Callable[..., subprocess.Popen[str]]) -> None:
    """The daemon, job 'victim''s trainers and an attacker of another job all run as uid 65534. The
    attacker is given the daemon's memfd descriptor numbers and tries /proc/<zend pid>/fd/N (read-write,
    read-only), listing /proc/<zend pid>/fd and /proc/<zend pid>/mem: each is EACCES. The same open of a
    dumpable process's 0600 memfd succeeds (a control: the refusal is the daemon's doing, not the
    machine's). The honest trainers' sums are right before and after."""
    env = {**os.environ, "HOME": str(nobody_dir), "PYTHONPATH": project_path(), "OMP_NUM_THREADS": "1",
           "NUMBA_CACHE_DIR": str(nobody_dir / "numba")}
    c = _AsNobody(1, nobody_dir / "cluster", env=env, metrics=False, extra=["--log-format", "text"])
    for path in (c.workdir, c.secret_file):  # the daemon makes its socket folder there and reads the secret
        os.chown(path, NOBODY, NOBODY)
    with c:
        pid = c.procs[0].pid
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"Uid:\t{NOBODY}\t{NOBODY}" in status, status
        trainer = spawned(HONEST_TRAINER, c.socket_dir(0), c.token("victim"), env=env)
        assert trainer.stdout is not None and trainer.stdin is not None
        first = json.loads(trainer.stdout.readline() or "null")
        assert first is not None, f"the trainer failed: {trainer.communicate(timeout=30)[1][-3000:]}"
        for got in first["sums"]:
            torch.testing.assert_close(torch.tensor(got), reference(0))

        # what root sees: the daemon's buffers, 0600 and owned by the daemon's uid; /proc/<pid> root's
        memfds = {}
        for name in os.listdir(f"/proc/{pid}/fd"):
            with_link = f"/proc/{pid}/fd/{name}"
            try:
                if os.readlink(with_link).startswith("/memfd:zend-buffer-"):
                    memfds[int(name)] = os.stat(with_link)
            except FileNotFoundError:
                continue
        assert len(memfds) >= 4, f"expected the trainers' input and result buffers, found {len(memfds)}"
        for st in memfds.values():
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == NOBODY, (oct(st.st_mode), st.st_uid)
        assert os.stat(f"/proc/{pid}/fd").st_uid == 0, "the daemon is dumpable: its /proc/<pid>/fd is its uid's"

        control = spawned(CONTROL, env=env)
        assert control.stdout is not None
        control_path = control.stdout.readline().strip()
        assert control_path, control.communicate(timeout=30)[1][-2000:]
        attacker = spawned(ATTACKER, str(pid), json.dumps(sorted(memfds)), control_path, env=env)
        out, err = attacker.communicate(timeout=60)
        assert attacker.returncode == 0, err[-2000:]
        seen = json.loads(out)
        assert seen.pop("uid") == NOBODY
        assert seen.pop("control") == "opened", "a same-uid dumpable process's memfd should open: no control"
        assert seen and all(v == "PermissionError" for v in seen.values()), seen

        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        second = json.loads(trainer.stdout.readline() or "null")
        assert second is not None, f"the trainer failed: {trainer.communicate(timeout=30)[1][-3000:]}"
        for got in second["sums"]:
            torch.testing.assert_close(torch.tensor(got), reference(1))
        assert trainer.wait(30) == 0
