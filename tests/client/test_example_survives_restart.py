"""Example (a) survives a daemon restart: node 1's zend is killed (-9) and started again as step 4
starts; every rank's loop catches zen's abort, waits for the cluster (`Client.wait_ready`) and
redoes the step from the same state, so the losses are those of a run without the fault. And it
survives a trainer's death: torchrun restarts the job, which resumes from its in-memory checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, poll_for

pytestmark = pytest.mark.daemon

ARGS = ["--launch", "--nodes", "2", "--trainers", "1", "--backend", "zen", "--steps", "8", "--dim", "16",
        "--layers", "1", "--heads", "2", "--context", "16", "--batch", "2", "--json"]
RTOL = 1e-4  # auto may pick another scheme after the restart: the same sums, in another order


def losses(extra: list[str]) -> tuple[list[float], str]:
    launcher = subprocess.Popen([sys.executable, str(ROOT / "examples/gpt_sparse.py"), *ARGS, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                start_new_session=True)
    try:
        out, err = launcher.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # SIGINT first: the launcher stops its daemons, store and ranks
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
        raise
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["loss"] for r in rows], err


def test_the_training_loop_redoes_the_aborted_step_and_its_losses_match_a_run_without_the_fault() -> None:
    plain, _ = losses([])
    faulty, log = losses(["--restart-daemon-at", "4"])
    assert "redoing the step" in log, log[-3000:]  # the fault really hit a step
    assert len(plain) == len(faulty) == 8
    for step, (a, b) in enumerate(zip(faulty, plain, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: {a} with the restart, {b} without"


def test_a_killed_trainer_restarts_the_job_which_resumes_from_its_newest_in_memory_checkpoint() -> None:
    """GEMINI's recovery, end to end: node 1's trainer dies (exit 1, no cleanup) as step 5 starts; torchrun
    (--max-restarts 1, c10d rendezvous) restarts every trainer; each loads the newest checkpoint complete on
    every node from its daemon's memory (saved every 2 steps, asynchronously) and goes on after it, its zen
    steps where the daemons are. At most the steps since that checkpoint are lost, and the losses are those
    of a run without the fault."""
    every = ["--checkpoint-every", "2"]
    plain, _ = losses(every)
    launcher = subprocess.run([sys.executable, str(ROOT / "examples/gpt_sparse.py"), *ARGS, *every, "--max-restarts",
                               "1", "--kill-trainer-at", "5"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert launcher.returncode == 0, launcher.stdout[-3000:] + launcher.stderr[-3000:]
    assert "rank 1: killed as step 5 starts" in launcher.stderr, launcher.stderr[-3000:]
    rows = [json.loads(line) for line in launcher.stdout.splitlines() if line.startswith("{")]
    steps = [r["step"] for r in rows]
    resumed = steps[5]  # the first step of the second life: after checkpoint 4, or 2 if 4's save was in flight
    assert steps == [0, 1, 2, 3, 4, *range(resumed, 8)] and resumed in (3, 5), steps
    final = {r["step"]: r["loss"] for r in rows}  # each step's last run
    for step, loss in enumerate(plain):
        assert abs(final[step] - loss) <= RTOL * abs(loss), f"step {step}: {final[step]} resumed, {loss} without"


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def test_a_sigterm_to_the_launcher_stops_every_agent_rank_and_daemon() -> None:
    """The agents run in sessions of their own; a `timeout` or a cancelled job must not orphan them."""
    import glob

    before = set(glob.glob("/tmp/zen-gpt-*"))
    launcher = subprocess.Popen([sys.executable, str(ROOT / "examples/gpt_sparse.py"), *ARGS, "--steps", "100000",
                                 "--seed", "424242"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=ROOT)
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()  # the first step: every part is up
        assert "loss" in line, line
        tmp = (set(glob.glob("/tmp/zen-gpt-*")) - before).pop()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) != 0
        def all_gone() -> bool:
            left = _processes_mentioning("424242") + _processes_mentioning(tmp)
            assert not left, left
            return True

        poll_for(all_gone, 15, "no agent, rank or daemon of the launcher left", interval_s=0.2,
                 ignore=(AssertionError,))
    finally:  # SIGTERM: the launcher stops what it started (a SIGKILL would orphan its daemons and agents)
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
