"""The fault drill (benchmarks/fault_drill.py): its schedule and its checker in-process, and a two-minute
drill of 3 nodes x 2 trainers under daemon restarts, freezes, trainer restarts and partitions, in network
namespaces (`slow`: 2.5 minutes of wall time when it passes, up to 4 when it finds a deadlock), and a
45-second drill on loopback whose trainer kills restart the job from its in-memory checkpoint.

The two-minute drill's seed: $ZEN_FAULT_DRILL_SEED, else a fixed one under CI ($CI set), else a new one each run
(the checkpoint drill always runs the fixed one's schedule, whose three trainer kills it counts);
a failure names it, and `python benchmarks/fault_drill.py --nodes 3 --duration-s 120 --seed S` replays
its schedule."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.subprocess_env import with_project

ROOT = Path(__file__).resolve().parents[2]
DRILL = ROOT / "benchmarks" / "fault_drill.py"
CI_SEED = 20261203


def _drill() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fault_drill", DRILL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_drill"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.inprocess
def test_the_schedule_comes_from_the_seed_alone_and_never_hits_a_node_twice_at_once() -> None:
    fd = _drill()
    first, _ = fd.make_schedule(7, 120.0, (6.0, 10.0), list(fd.KINDS), 3, 2)
    again, _ = fd.make_schedule(7, 120.0, (6.0, 10.0), list(fd.KINDS), 3, 2)
    other, _ = fd.make_schedule(8, 120.0, (6.0, 10.0), list(fd.KINDS), 3, 2)
    assert [f.describe() for f in first] == [f.describe() for f in again]
    assert [f.describe() for f in first] != [f.describe() for f in other]
    assert 10 <= len(first) <= 20
    counts = [sum(f.kind == kind for f in first) for kind in fd.KINDS]
    assert max(counts) - min(counts) <= 2, counts  # in shuffled rounds (minus a fault skipped here and there)
    for a, b in itertools.pairwise(first):
        assert b.at_s - a.at_s >= 6.0  # more where every node was busy and a fault was skipped
    for f in first:
        lo, hi = fd.HOLD_S[f.kind]
        assert lo <= f.hold_s <= hi
        later = [g for g in first if g.node == f.node and g.at_s > f.at_s]
        assert not later or later[0].at_s >= f.at_s + f.hold_s, (f.describe(), later[0].describe())


@pytest.mark.inprocess
def test_the_checker_finds_wrong_sums_split_steps_a_short_trainer_and_a_resume_behind_the_job() -> None:
    fd = _drill()
    seed, world = 3, 2
    logs = {(n, 0): fd.TrainerLog(Path(f"/nonexistent/{n}")) for n in range(world)}

    def ok(node: int, step: int, t: float, digest: str | None = None, total: int | None = None) -> None:
        ref_digest, ref_total, _ = fd.reference(seed, world, step)
        logs[(node, 0)].events.append({"t": t, "pid": 1, "ev": "ok", "step": step, "hash": digest or ref_digest,
                                       "total": ref_total if total is None else total})

    for node in range(world):
        logs[(node, 0)].events.append({"t": 0.0, "pid": 1, "ev": "start", "step": 0})
        for step in range(5):
            ok(node, step, 1.0 + step)
    clean = fd.check_results(logs, seed, world, None)
    assert clean["wrong_sums"]["ok"] and clean["split_steps"]["ok"] and clean["resumed_behind"]["ok"]
    assert clean["skipped_steps"]["ok"] and clean["checked"]["trainer_steps"] == 10
    assert not clean["final_step"]["ok"]  # no target: nobody was stopped

    # node 1 gets only its own gradient at step 5: rank 0's is missing
    ok(0, 5, 6.0)
    rows, values = fd.gradient(seed, 1, 5)
    alone = fd.dense_of(rows, values)
    ok(1, 5, 6.0, digest=fd.digest(alone), total=int(alone.sum()))
    # a trainer restarted at step 2, after step 4 was delivered: told a step behind the job
    logs[(0, 0)].events.append({"t": 5.5, "pid": 2, "ev": "start", "step": 2})
    for node in range(world):
        logs[(node, 0)].events.append({"t": 7.0, "pid": 1, "ev": "done", "step": 6 + node})
    found = fd.check_results(logs, seed, world, 6)
    assert found["wrong_sums"]["count"] == 1 and "rank 0 missing" in found["wrong_sums"]["details"][0]
    assert found["split_steps"]["count"] == 1 and "step 5" in found["split_steps"]["details"][0]
    assert found["resumed_behind"]["count"] == 1 and "at step 2" in found["resumed_behind"]["details"][0]
    assert not found["final_step"]["ok"] and "trainer 1.0: 7" in found["final_step"]["details"]


@pytest.mark.inprocess
def test_recovery_is_measured_from_the_heal_to_every_trainers_next_step() -> None:
    fd = _drill()
    f = fd.Fault(0, 1.0, "freeze", 0, 0, 2.0, injected=10.0, healed=12.0)
    logs = {(n, 0): fd.TrainerLog(Path(f"/nonexistent/{n}")) for n in range(2)}
    logs[(0, 0)].events = [{"t": 9.0, "ev": "ok", "step": 1}, {"t": 15.0, "ev": "error", "step": 2},
                           {"t": 16.0, "ev": "ok", "step": 2}]
    logs[(1, 0)].events = [{"t": 9.0, "ev": "ok", "step": 1}, {"t": 15.5, "ev": "error", "step": 2},
                           {"t": 17.5, "ev": "ok", "step": 2}]
    fd.measure_recovery([f], logs, end=100.0)
    assert f.detect_s == pytest.approx(5.5) and f.recover_s == pytest.approx(5.5) and not f.overlapped


@pytest.mark.inprocess
def test_the_checkpoint_checker_finds_a_wrong_model_a_split_restore_and_work_lost_beyond_the_last_checkpoint() -> None:
    fd = _drill()
    logs = {(n, 0): fd.TrainerLog(Path(f"/nonexistent/{n}")) for n in range(2)}
    model = {step: f"m{step}" for step in range(10)}  # the model's digest after each step

    def life(node: int, life: int, restored: int | None, steps: range, param: str | None = None) -> None:
        zero = fd.digest(torch.zeros(fd.NUM_ROWS, fd.DIM))
        logs[(node, 0)].events.append({"t": 0.0, "ev": "restore", "step": restored, "life": life, "seconds": 0.1,
                                       "param": param or (zero if restored is None else model[restored])})
        logs[(node, 0)].events += [{"t": 1.0, "ev": "ok", "step": s, "param": model[s]} for s in steps]

    for node in range(2):
        life(node, 0, None, range(0, 6))
        life(node, 1, 4, range(6, 10))
    restart = {"life": 0, "why": "fault #0", "delivered": 5, "complete": 4}
    clean = fd.check_checkpoints(logs, [dict(restart)])
    assert clean["ok"], clean["details"]
    assert clean["lost"] == [1] and clean["restarts"][0]["since_complete"] == 1

    older = fd.check_checkpoints(logs, [{**restart, "complete": 5}])  # step 5 was complete: 4 is one too old
    assert not older["ok"] and "restored step 4, but step 5 was complete on every node" in older["details"][0]

    logs[(1, 0)].events[-5]["param"] = "not-m4"  # node 1's second life restored other bytes than step 4's
    wrong = fd.check_checkpoints(logs, [dict(restart)])
    assert not wrong["ok"] and "trainer 1.0 life 1: restored step 4 as not-m4" in wrong["details"][0]

    logs[(1, 0)].events[-5].update(step=2, param=model[2])  # ... or another step than node 0's
    split = fd.check_checkpoints(logs, [dict(restart)])
    assert any("life 1: the trainers restored different steps [2, 4]" in d for d in split["details"]), split


def _seed() -> int:
    if os.environ.get("ZEN_FAULT_DRILL_SEED"):
        return int(os.environ["ZEN_FAULT_DRILL_SEED"])
    return CI_SEED if os.environ.get("CI") else random.randrange(1 << 31)


@pytest.mark.netns
@pytest.mark.slow  # 2 minutes of faults, about 3 in all
@pytest.mark.timeout(540)
def test_a_two_minute_drill_delivers_every_sum_right_and_leaves_nothing_behind() -> None:
    from zend.cluster.netns import available

    reason = available()
    if reason:
        pytest.skip(f"the drill's partitions need network namespaces: {reason}")
    report = _run_drill(["--nodes", "3", "--trainers", "2", "--duration-s", "120", "--fault-every-s", "6-10",
                         "--faults", "daemon_restart,freeze,trainer_restart,partition"], timeout_s=480)
    assert report["fault_phase_s"] >= 115 and sum(k["count"] for k in report["recovery"].values()) >= 10


@pytest.mark.daemon
@pytest.mark.timeout(300)
def test_a_job_killed_with_a_trainer_resumes_from_its_in_memory_checkpoint_under_daemon_faults() -> None:
    """GEMINI's loop in the drill: each trainer kill restarts the whole job (torchrun's way), which loads the
    newest checkpoint complete on every node; daemons are killed and frozen between. The drill checks the
    restored model bit for bit and that no restart lost more than the iterations since that checkpoint."""
    # one schedule, whatever $CI says: 3 trainer kills (#2, #3, #6) among daemon restarts and freezes
    report = _run_drill(["--nodes", "2", "--trainers", "2", "--duration-s", "45", "--fault-every-s", "5-7",
                         "--faults", "trainer_restart,daemon_restart,freeze", "--loopback", "--checkpoint-every", "3"],
                        timeout_s=240, seed=CI_SEED)
    assert [f["kind"] for f in report["faults"]].count("trainer_restart") == 3, report["faults"]
    restarts = [r for r in report["checks"]["checkpoints"]["restarts"] if r["lost"] is not None]
    assert len(restarts) >= 2, report["checks"]["checkpoints"]["restarts"]  # a kill may fall in a restart
    assert all(r["restored"] is not None and 0 <= r["lost"] <= r["since_complete"] for r in restarts), restarts


def _run_drill(args: list[str], timeout_s: float, seed: int | None = None) -> dict:
    """The drill as a user runs it (a process of its own, --json), every check of its report passed."""
    seed = _seed() if seed is None else seed
    argv = [sys.executable, str(DRILL), *args, "--seed", str(seed), "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=with_project(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the drill cleans up (namespaces, daemons, trainers) on SIGTERM
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"the drill (seed {seed}) did not end within {timeout_s:g} s:\n{err[-6000:]}")
    print(err)  # the schedule and what happened (pytest -s shows it)
    try:
        report = json.loads(out)
    except ValueError:
        pytest.fail(f"the drill (seed {seed}) exited with {proc.returncode} and no report:\n{err[-6000:]}")
    failed = {name: check for name, check in report["checks"].items() if not check["ok"]}
    lines = [f"{name}: " + "\n    ".join(str(d)[:1500] for d in check.get("details", [])[:5])
             for name, check in failed.items()]
    assert not failed and proc.returncode == 0, (
        f"the fault drill failed with seed {seed} (replay: {report['replay']}); logs in {report['workdir']}\n"
        + "\n".join(lines))
    return report
