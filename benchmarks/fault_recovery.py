"""How fast faults are detected and steps recover: real daemons, real trainers, real signals.

n daemons (one process each; in network namespaces with links shaped to --rate-mbit, or on
loopback with --rate-mbit 0), two trainers per node stepping one sparse tensor in a loop; a
trainer whose step is aborted (zen.StepAborted / ABORTED) submits the same step again. Faults,
one after the other, each after a few good steps:
- freeze: SIGSTOP of the last node's daemon. detect: from the signal to the last survivor's
  abort ("held" when a survivor lost it in the commit's second round and holds its result until it
  is back, so that no trainer sees an error). recover: from SIGCONT to every trainer's next good step.
- trainer kill: kill -9 of node 0's second trainer (a process of its own). detect: from the
  kill to the last other trainer's abort. recover: from the kill to every trainer's next good
  step, a replacement trainer started at once (it is told the step the job is at).
- daemon restart: kill -9 of the last node's daemon, started again at once with the same rank
  (the cluster is elastic: `--elastic 1`, a `zend store`). detect: from the kill to the last
  survivor's abort. recover: from the kill to every trainer's next good step (the members form
  a new generation; the restarted node's trainers open new sessions at the step the job is at,
  which the daemon tells them: `job_step`).
- generation freeze: the daemon restart again, and node 0's daemon frozen (SIGSTOP) from the kill
  until 6 s after the restart, while the members would form the new generation. recover: from
  SIGCONT to every trainer's next good step.

    python benchmarks/fault_recovery.py --nodes 3,8 --rate-mbit 1000 [--peer-timeout-s 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zend.cluster.local import LocalCluster  # noqa: E402
from zend.cluster.netns import EmulatedCluster  # noqa: E402
from zend.core.sparse import SparseGrad  # noqa: E402
from zend.protocol.session import TrainerSession  # noqa: E402
from zend.protocol.step import StepFailed  # noqa: E402

ROWS, DIM = 20_000, 16
GENERATION_FREEZE_S = 6.0
TRAINER = """
import sys, time, torch
from zend.core.sparse import SparseGrad
from zend.protocol.session import TrainerSession
from zend.protocol.step import StepFailed
socket_dir, token, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
link = TrainerSession(socket_dir, "j", token, 1, 2, timeout_s=120)
h = link.register("emb", ({rows}, {dim}))
while True:
    g = torch.Generator().manual_seed(step)
    grad = SparseGrad(torch.randint(0, {rows}, (2000,), generator=g), torch.randn(2000, {dim}, generator=g), {rows})
    try:
        link.allreduce(h, grad, step)
        print("ok", step, time.monotonic(), flush=True)
        step += 1
    except StepFailed as exc:
        print("aborted", step, time.monotonic(), flush=True)
        time.sleep(0.05)
"""


class Trainer:
    """A trainer thread: steps in a loop, the same step again after an abort; keeps what happened when."""

    def __init__(self, cluster: LocalCluster, node: int, local_rank: int, step: int | None = 0):
        self.link = TrainerSession(cluster.socket_dir(node), "j", cluster.token("j"), local_rank, 2, timeout_s=120)
        self.handle = self.link.register("emb", (ROWS, DIM))
        # step None: where the daemon says the job is (a trainer that joins a running job)
        self.step, self.events, self.stop = self.link.job_step if step is None else step, [], False
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop:
            g = torch.Generator().manual_seed(self.step)
            grad = SparseGrad(torch.randint(0, ROWS, (2000,), generator=g), torch.randn(2000, DIM, generator=g), ROWS)
            try:
                self.link.allreduce(self.handle, grad, self.step)
                self.events.append(("ok", self.step, time.monotonic()))
                self.step += 1
            except StepFailed as exc:
                self.events.append((exc.code, self.step, time.monotonic()))
                if self.stop:
                    return
                time.sleep(0.05)
            except ConnectionError:  # its daemon was killed: the thread of a trainer that is being replaced
                if self.stop:
                    return
                raise

    def first(self, kind: str, after: float) -> float | None:
        return next((t for k, _, t in list(self.events) if (k == kind or (kind == "error" and k != "ok"))
                     and t > after), None)


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def scenario(n: int, rate_mbit: float, peer_timeout_s: float) -> dict[str, float | None]:
    extra = ["--peer-timeout-s", str(peer_timeout_s), "--step-timeout-s", "120", "--log-format", "text",
             "--scheme", "zen"]
    with tempfile.TemporaryDirectory() as tmp:
        emulated = EmulatedCluster(n, rate_mbit=rate_mbit).__enter__() if rate_mbit else None
        try:
            with LocalCluster(n, tmp, emulated=emulated, extra=extra, elastic=True) as c:
                return _faults(c, n, peer_timeout_s)
        finally:
            if emulated is not None:
                emulated.__exit__(None, None, None)


def _faults(c: LocalCluster, n: int, peer_timeout_s: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    victim_cmd = [sys.executable, "-c", TRAINER.format(rows=ROWS, dim=DIM), c.socket_dir(0), c.token("j")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    victim = subprocess.Popen([*victim_cmd, "0"], stdout=subprocess.PIPE, text=True, env=env)
    trainers = {(node, r): Trainer(c, node, r) for node in range(n) for r in range(2) if (node, r) != (0, 1)}
    for t in trainers.values():
        t.thread.start()
    try:
        everyone = list(trainers.values())
        wait_for(lambda: all(t.step >= 5 for t in everyone), 120, "5 good steps")
        # freeze the last daemon
        others = [t for (node, _), t in trainers.items() if node != n - 1]
        t0 = time.monotonic()
        c.send_signal(n - 1, signal.SIGSTOP)
        try:  # a survivor that lost the frozen node in the commit's second round holds its result (no abort)
            wait_for(lambda: all(t.first("error", t0) for t in others), 2 * peer_timeout_s + 5, "aborts")
            out["freeze_detect_s"] = max(t.first("error", t0) or 0 for t in others) - t0
        except TimeoutError:
            out["freeze_detect_s"] = None  # held until the thaw: no trainer saw an error
        t1 = time.monotonic()
        c.send_signal(n - 1, signal.SIGCONT)
        wait_for(lambda: all(t.first("ok", t1) for t in everyone), 120, "a good step after the thaw")
        out["freeze_recover_s"] = max(t.first("ok", t1) or 0 for t in everyone) - t1
        # kill -9 a trainer; its replacement starts at the step the job is at
        wait_for(lambda: all(t.first("ok", time.monotonic() - 0.5) for t in everyone), 60, "steady again")
        t2 = time.monotonic()
        victim.kill()
        victim.wait()
        wait_for(lambda: all(t.first("error", t2) for t in everyone), 60, "the aborts after the trainer kill")
        out["trainer_kill_detect_s"] = max(t.first("error", t2) or 0 for t in everyone) - t2
        at = min(t.step for t in everyone)
        victim = subprocess.Popen([*victim_cmd, str(at)], stdout=subprocess.PIPE, text=True, env=env)
        wait_for(lambda: all(t.step > at for t in everyone), 120, "a good step after the replacement")
        out["trainer_kill_recover_s"] = max(t.first("ok", t.first("error", t2) or t2) or 0 for t in everyone) - t2
        # kill -9 the last daemon and start it again: a new generation, new sessions on that node
        t3 = time.monotonic()
        c.kill(n - 1)
        wait_for(lambda: all(t.first("error", t3) for t in others), 60, "the aborts after the daemon kill")
        out["daemon_kill_detect_s"] = max(t.first("error", t3) or 0 for t in others) - t3
        for (node, r), t in list(trainers.items()):
            if node == n - 1:
                t.stop = True  # its session died with the daemon
                del trainers[(node, r)]
        c.start_node(n - 1)
        c.wait_ready(n - 1, 120)
        for r in range(2):
            trainers[(n - 1, r)] = fresh = Trainer(c, n - 1, r, step=None)
            fresh.thread.start()
        everyone = list(trainers.values())
        wait_for(lambda: all(t.first("ok", t3) for t in everyone), 120, "a good step after the daemon restart")
        out["daemon_restart_recover_s"] = max(t.first("ok", t3) or 0 for t in everyone) - t3
        # the same, and node 0's daemon frozen while the new generation forms, thawed 6 s later
        wait_for(lambda: all(t.first("ok", time.monotonic() - 0.5) for t in everyone), 60, "steady again")
        c.kill(n - 1)
        c.send_signal(0, signal.SIGSTOP)
        for r in range(2):
            trainers.pop((n - 1, r)).stop = True
        c.start_node(n - 1)
        time.sleep(GENERATION_FREEZE_S)
        t4 = time.monotonic()
        c.send_signal(0, signal.SIGCONT)
        c.wait_ready(n - 1, 120)
        for r in range(2):
            trainers[(n - 1, r)] = fresh = Trainer(c, n - 1, r, step=None)
            fresh.thread.start()
        everyone = list(trainers.values())
        wait_for(lambda: all(t.first("ok", t4) for t in everyone), 120, "a good step after the thaw")
        out["generation_freeze_recover_s"] = max(t.first("ok", t4) or 0 for t in everyone) - t4
    finally:
        for t in trainers.values():
            t.stop = True
        victim.kill()
        victim.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="3,8")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="0: loopback, no namespaces")
    p.add_argument("--peer-timeout-s", type=float, default=5.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        rows.append({"n": n, "rate_mbit": args.rate_mbit, "peer_timeout_s": args.peer_timeout_s,
                     **scenario(n, args.rate_mbit, args.peer_timeout_s)})
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    print(f"fault detection and recovery, peer timeout {args.peer_timeout_s:g} s, "
          f"{'loopback' if not args.rate_mbit else f'{args.rate_mbit:g} Mbit/s emulated'}; seconds")
    cols = ["freeze_detect_s", "freeze_recover_s", "trainer_kill_detect_s", "trainer_kill_recover_s",
            "daemon_kill_detect_s", "daemon_restart_recover_s", "generation_freeze_recover_s"]
    print(f"{'n':>3} " + " ".join(f"{c[:-2]:>26}" for c in cols))
    for r in rows:
        print(f"{r['n']:>3} " + " ".join(f"{r[c]:26.2f}" if r[c] is not None else f"{'held':>26}" for c in cols))


if __name__ == "__main__":
    from zend.cluster.launcher import signals_end_the_job

    with signals_end_the_job():  # SIGTERM unwinds like Ctrl-C: its namespaces and processes go too
        main()
