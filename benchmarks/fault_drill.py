"""A fault drill: an elastic zen cluster training under random faults, every result checked.

N daemons (`zend serve --elastic 1` over a `zend store`, in network namespaces of their own, the store in
one more; or on loopback with --loopback), T trainer processes per node on `zen.Client`, each stepping
two sparse tables (fused into one tensor, as `allreduce_many` does) with a gradient that depends only on
(seed, rank, step): small integers, so that every sum is exact whatever the order of the additions and the
checker can compute what any step must deliver. Trainers retry as the README says: after StepAborted or
DaemonUnavailable, `wait_ready()` and the same step again; after OutOfOrder from `wait_ready()`, resume
at `client.job_step`; a restarted trainer starts at `client.job_step`. Anything else is a crash, which
the drill records and answers as a supervisor would (a new trainer process).

Every F seconds (uniform in --fault-every-s) a fault hits a node not already under one:
- daemon_restart: the daemon killed -9, started again with the same rank 0-3 s later;
- freeze: the daemon stopped (SIGSTOP) for 1-8 s, then SIGCONT;
- trainer_restart: one trainer killed -9, a new one started 0-3 s later;
- partition: the node's link down (its veth on the hub's bridge) for 1-8 s (namespaces only);
- cluster_restart: every daemon killed -9 at once, all started again 0-3 s later (no daemon remembers
  where the job is; steps in flight end differently for different trainers); not in the default set.
The schedule comes from --seed alone (printed before the run): a failing run is replayed with its seed.

At the end (--duration-s of faults) every fault is healed, the trainers are told a common last step, and
the drill checks: every delivered sum equals the reference (bit for bit: the sums are exact); no step was
delivered with different results on different trainers; every trainer stopped at the same step; the job
never went --stall-s without a step (a deadlock, reported with `zend status --json` of every daemon and
each trainer's last words); no trainer crashed and no daemon exited on its own; no restarted trainer was
told a step behind the job; the job skipped no step; and nothing leaked: no process of the run, no
network namespace, no /dev/shm file or zend memfd of ours held by anyone after the run, and no session
or buffer (memfd) kept by a daemon once every trainer had left.
It prints recovery times per fault kind (detect: from the fault to the last trainer's first error;
recover: from the heal to every trainer's next delivered step) and exits 1 if any check failed.

    python benchmarks/fault_drill.py --nodes 3 --duration-s 120 --fault-every-s 6-10 \\
        --faults daemon_restart,freeze,trainer_restart,partition --seed 7 [--json] [--loopback]

With --checkpoint-every K the trainers are stateful, as GEMINI's are: each keeps a model (every result summed)
and checkpoints it in the daemons' memory every K steps (zen.checkpoint.Checkpointer, DCP's async_save on a
gloo group per life of the job). A trainer's death, or a trainer told OutOfOrder (it lost a result the others
have), then restarts the whole job as torchrun does, and every trainer loads the newest checkpoint complete on
every node and goes on at the daemons' next step (the drill's gradients are keyed by step: the steps after the
checkpoint are lost, not redone, which the checks count). Checked besides: the restored model is bit for bit
the one the trainers had after that step, every trainer of a life restored the same step, the models never
differ, and no restart lost more than the iterations since the newest checkpoint every node had reported
complete before the job was killed.

A failing run prints its replay command; `--only 12-13` replays a part of the seed's schedule (its spacing
kept, the first fault 6 s in), `--stall-s 30` gives up on a deadlock sooner, `--keep` keeps the logs
(trainer-N.L.jsonl: every event of trainer L of node N; nodeN.log, store.log; deadlock-K.json: each
daemon's status and where each trainer was, from faulthandler). `--trainer-loop helper` runs the trainers on
`zen.step_surviving_faults` (5 redos, then the error is a crash) instead of the README's loop.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zend.cluster.local import LocalCluster  # noqa: E402

KINDS = ("daemon_restart", "freeze", "trainer_restart", "partition")
EXTRA_KINDS = ("cluster_restart",)  # asked for by name: --faults ...,cluster_restart
HOLD_S = {"daemon_restart": (0.0, 3.0), "freeze": (1.0, 8.0), "trainer_restart": (0.0, 3.0), "partition": (1.0, 8.0),
          "cluster_restart": (0.0, 3.0)}
JOB, TENSOR = "drill", "tables"
ROWS_A, ROWS_B, DIM = 1000, 200, 8  # two tables, fused into one tensor of ROWS_A + ROWS_B rows
NUM_ROWS = ROWS_A + ROWS_B
NNZ_A, NNZ_B = 48, 16  # rows each trainer sends per step (duplicates on purpose: the daemon coalesces)
MARKER = "ZEN_FAULT_DRILL_RUN"  # in the environment of every process of a run: what the leak check looks for
STORE_PORT = 29500


# ---------------------------------------------------------------------------------------------- the workload
def gradient(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer `rank`'s (indices, values) at `step`: rows of both tables, values small integers (exact sums)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + rank) * 1_000_003 + step) % (1 << 62))
    rows = torch.cat([torch.randint(0, ROWS_A, (NNZ_A,), generator=g),
                      torch.randint(ROWS_A, NUM_ROWS, (NNZ_B,), generator=g)])
    return rows, torch.randint(-4, 5, (rows.numel(), DIM), generator=g).to(torch.float32)


def dense_of(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(NUM_ROWS, DIM, dtype=torch.float32)
    out.index_add_(0, rows.to(torch.int64), values.to(torch.float32))
    return out + 0.0  # -0.0 -> 0.0: a row that sums to zero hashes alike however it was summed


def digest(dense: torch.Tensor) -> str:
    return hashlib.sha1(dense.contiguous().numpy().tobytes()).hexdigest()[:16]


def reference(seed: int, world: int, step: int) -> tuple[str, int, list[int]]:
    """What step `step` must deliver: its digest, its total, and each rank's total (to name a missing one)."""
    parts = [gradient(seed, rank, step) for rank in range(world)]
    total = dense_of(torch.cat([r for r, _ in parts]), torch.cat([v for _, v in parts]))
    return digest(total), int(total.sum()), [int(v.sum()) for _, v in parts]


# ------------------------------------------------------------------------------------------------ a trainer
def trainer_main(argv: list[str]) -> int:
    """One trainer process: steps until the stop file names a step it has reached; every event a JSON line."""
    import zen

    p = argparse.ArgumentParser(prog="fault_drill.py trainer")
    for name in ("--socket-dir", "--log", "--stop"):
        p.add_argument(name, required=True)
    for name in ("--node", "--local", "--locals", "--seed"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--loop", choices=["readme", "helper"], default="readme")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--gloo-store", default="", help="host:port of the drill's TCPStore (with --checkpoint-every)")
    p.add_argument("--life", type=int, default=0, help="which life of the job (with --checkpoint-every)")
    p.add_argument("--world", type=int, default=0, help="trainers in the job (with --checkpoint-every)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the drill asks where we are at a deadlock
    fd = os.open(a.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(event: str, **fields: Any) -> None:  # one write per line: whole lines even after kill -9
        os.write(fd, (json.dumps({"t": time.monotonic(), "pid": os.getpid(), "ev": event, **fields}) + "\n").encode())

    rank, token = a.node * a.locals + a.local, os.environ["ZEN_JOB_TOKEN"]
    while True:  # a session, once the daemon serves (it may be dead, frozen or joining)
        try:
            client = zen.Client(a.socket_dir, job=JOB, token=token, local_rank=a.local, local_world_size=a.locals,
                                timeout_s=600, wait_s=30)
            break
        except zen.DaemonUnavailable as exc:
            note("waiting", where="connect", msg=str(exc)[:400])
    ckpt: Any = None
    param = torch.zeros(0)
    if a.checkpoint_every:
        ckpt, param = _restore(a, rank, client, note)
    step = client.job_step  # where the job is: a restarted trainer resumes there
    note("start", step=step, gen=client.generation, life=a.life)
    while True:
        target = _stop_step(a.stop)
        if target is not None and step >= target:
            note("done", step=step)
            break
        rows, values = gradient(a.seed, rank, step)
        try:
            if a.loop == "helper":  # zen.step_surviving_faults (examples/common.py's loop) redoes, we resume
                def run(r: torch.Tensor = rows, v: torch.Tensor = values, s: int = step) -> Any:
                    return client.allreduce((r, v), name=TENSOR, num_rows=NUM_ROWS, step=s)

                out_rows, out_values = zen.step_surviving_faults(run, client)
            else:
                out_rows, out_values = client.allreduce((rows, values), name=TENSOR, num_rows=NUM_ROWS, step=step)
        except (zen.StepAborted, zen.DaemonUnavailable) as exc:  # the README's loop: wait, redo the same step
            if a.loop == "helper":
                note("crash", step=step, kind=type(exc).__name__, msg=str(exc)[:400])
                return 3
            note("error", step=step, kind=type(exc).__name__, msg=str(exc)[:400])
            while True:
                try:
                    client.wait_ready(60)
                    break
                except zen.OutOfOrder as behind:  # the job went on without this trainer: resume where it is
                    if ckpt is not None:
                        return _left_behind(note, step, behind)
                    note("resume", step=step, to=client.job_step, msg=str(behind)[:400])
                    step = client.job_step
                    break
                except zen.DaemonUnavailable as still:
                    note("waiting", where="wait_ready", step=step, msg=str(still)[:400])
            continue
        except zen.OutOfOrder as behind:  # from the helper's wait_ready: resume where the job is
            if a.loop != "helper":
                note("crash", step=step, kind=type(behind).__name__, msg=str(behind)[:400])
                return 3
            if ckpt is not None:
                return _left_behind(note, step, behind)
            note("resume", step=step, to=client.job_step, msg=str(behind)[:400])
            step = client.job_step
            continue
        except zen.ZenError as exc:  # not a fault the loop redoes: a crash (the drill restarts us)
            note("crash", step=step, kind=type(exc).__name__, msg=str(exc)[:400])
            return 3
        dense = dense_of(out_rows, out_values)
        model: dict[str, str] = {}
        if ckpt is not None:
            param += dense  # the model: every result summed (small integers: exact, whatever the order)
            model["param"] = digest(param)
        note("ok", step=step, hash=digest(dense), total=int(dense.sum()), gen=client.generation, **model)
        if ckpt is not None:
            _checkpoint(ckpt, param, step, note)
        step += 1
        if a.pause_s:
            time.sleep(a.pause_s)
    if ckpt is not None:
        with contextlib.suppress(Exception):  # a save that failed at the end costs nothing: the job is over
            ckpt.wait()
    client.close()
    return 0


LEFT_BEHIND = 4  # a trainer's exit status: it lost a result the others have; its job must restart


def _left_behind(note: Callable[..., None], step: int, behind: Exception) -> int:
    """(--checkpoint-every) OutOfOrder: the job delivered a step this trainer lost. With a model, it cannot
    skip ahead (its model would lack that result, unlike the others'): it exits, and the job restarts from
    its newest complete checkpoint, as examples/common.py's loop does under torchrun."""
    note("behind", step=step, msg=str(behind)[:400])
    return LEFT_BEHIND


def _restore(a: argparse.Namespace, rank: int, client: Any, note: Callable[..., None]) -> tuple[Any, torch.Tensor]:
    """(--checkpoint-every) This life's gloo group, its Checkpointer, and the model: the newest checkpoint complete
    for the whole job (zeros when there is none). Every trainer of the life gets the same outcome of each attempt
    (DCP's collectives and Checkpointer.agreed_step share failures), so they retry together."""
    import datetime

    import torch.distributed as dist
    import zen
    import zen.checkpoint

    host, _, port = a.gloo_store.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"life-{a.life}", store), rank=rank,
                            world_size=a.world,
                            timeout=datetime.timedelta(seconds=300))
    ckpt = zen.checkpoint.Checkpointer(every=a.checkpoint_every, client=client, asynchronous=True)
    param = torch.zeros(NUM_ROWS, DIM, dtype=torch.float32)
    why = ""
    for attempt in range(5):
        try:
            started = time.monotonic()
            loaded = ckpt.load_latest({"param": param})
            note("restore", step=loaded, param=digest(param), life=a.life, seconds=round(time.monotonic() - started, 3),
                 attempts=attempt + 1)
            return ckpt, param
        except Exception as exc:  # zen.checkpoint.CheckpointError (DCP's failure, every rank alike), or the daemon's
            why = f"{type(exc).__name__}: {str(exc)[:400]}"
            note("restore-error", life=a.life, attempt=attempt + 1, msg=why)
            param.zero_()  # a load that failed part-way may have written some of it
            with contextlib.suppress(zen.ZenError):
                client.wait_ready(60)
            dist.barrier()
    note("restore", step=None, param=digest(param), life=a.life, msg=why, attempts=5)
    return ckpt, param


def _checkpoint(ckpt: Any, param: torch.Tensor, step: int, note: Callable[..., None]) -> None:
    """(--checkpoint-every) Before each save, what the node holds complete (what the drill checks a restore
    against); then the save, asynchronous. A save that fails is noted, and training goes on."""
    import zen

    if step % ckpt.every:
        return
    try:
        note("held", step=step, complete=ckpt.complete_steps()[:3])
    except zen.ZenError as exc:
        note("held", step=step, complete=None, msg=str(exc)[:200])
    try:
        ckpt.save({"param": param}, step)  # waits for the save before (its failure is raised here)
    except Exception as exc:  # CheckpointError (this save's, or the one before it), or the daemon's error
        note("save-error", step=step, msg=f"{type(exc).__name__}: {str(exc)[:400]}")


def _stop_step(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------- schedule
@dataclass
class Fault:
    index: int
    at_s: float  # planned: seconds into the fault phase
    kind: str
    node: int
    local: int  # trainer_restart: which trainer of the node
    hold_s: float  # freeze, partition: how long; daemon_restart, trainer_restart: how long down
    injected: float | None = None  # monotonic times, filled in by the run
    healed: float | None = None
    detect_s: float | None = None
    recover_s: float | None = None
    overlapped: bool = False  # the next fault came before every trainer delivered a step again
    errors: int = 0  # errors the trainers saw (failed attempts) from this fault to the next
    note: str = ""

    def describe(self) -> str:
        what = {"daemon_restart": f"daemon of node {self.node} killed -9, restarted after {self.hold_s:.1f} s",
                "freeze": f"daemon of node {self.node} frozen (SIGSTOP) for {self.hold_s:.1f} s",
                "trainer_restart": f"trainer {self.node}.{self.local} killed -9, restarted after {self.hold_s:.1f} s",
                "partition": f"node {self.node}'s link down for {self.hold_s:.1f} s",
                "cluster_restart": f"every daemon killed -9, restarted after {self.hold_s:.1f} s"}[self.kind]
        return f"#{self.index:<3} +{self.at_s:6.1f} s  {what}"


def make_schedule(seed: int, duration_s: float, every_s: tuple[float, float], kinds: list[str], nodes: int,
                  trainers: int) -> tuple[list[Fault], list[str]]:
    """The faults of a run (and the ones skipped because every node was busy), from the seed alone."""
    rng, faults, skipped = random.Random(seed), list[Fault](), list[str]()
    busy_until = [0.0] * nodes
    t, bag = 0.0, list[str]()
    while True:
        t += rng.uniform(*every_s)
        if t >= duration_s:
            return faults, skipped
        if not bag:  # the kinds in shuffled rounds: each as often as the others, in a random order
            bag = rng.sample(kinds, len(kinds))
        kind = bag.pop()
        hold = rng.uniform(*HOLD_S[kind])
        free = [n for n in range(nodes) if busy_until[n] <= t]
        node, local = rng.choice(range(nodes)), rng.randrange(trainers)
        if not free or (kind == "cluster_restart" and len(free) < nodes):
            skipped.append(f"+{t:.1f} s {kind}: {'every' if not free else 'a'} node is under a fault")
            continue
        if node not in free:
            node = free[node % len(free)]
        for hit in (range(nodes) if kind == "cluster_restart" else [node]):
            busy_until[hit] = t + hold
        faults.append(Fault(len(faults), round(t, 2), kind, node, local, round(hold, 2)))


# ------------------------------------------------------------------------------------------- trainer logs
@dataclass
class TrainerLog:
    """The events of one trainer slot (node, local), every incarnation of it, read as they are written."""

    path: Path
    offset: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        new = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                new.append(json.loads(line))
        self.events.extend(new)
        return new

    def oks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "ok"]


# -------------------------------------------------------------------------------------------- the cluster
class DrillCluster(LocalCluster):
    """LocalCluster whose store (elastic) lives in a namespace of its own when emulated: host `nodes`, so
    that a node's partition cuts that node, not the store with it."""

    def __init__(self, nodes: int, workdir: Path, emulated: Any, **kwargs: Any):
        super().__init__(nodes, workdir, emulated=emulated, elastic=True, **kwargs)
        if emulated is not None:
            self.store = f"{emulated.address(nodes)}:{STORE_PORT}"

    def start_store(self) -> None:
        if self.emulated is None:
            super().start_store()
            return
        argv = [sys.executable, "-m", "zend", "store", "--listen", self.store, *self.store_extra]
        self.store_proc = self._popen(argv, self.nodes, self.workdir / "store.log")
        host, _, port = self.store.rpartition(":")
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections (from inside a node's namespace: over the bridge)
            if self.store_proc.poll() is not None:
                raise RuntimeError(f"zend store exited with {self.store_proc.returncode}: "
                                   f"{(self.workdir / 'store.log').read_text(errors='replace')[-2000:]}")
            probe = subprocess.run(["ip", "netns", "exec", self.emulated.namespace(0), "timeout", "2", "bash", "-c",
                                    f"exec 3<>/dev/tcp/{host}/{port}"], capture_output=True)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"zend store at {self.store} not up within 30 s")
            time.sleep(0.2)

    def close(self) -> None:
        """The daemons first, then the store (a daemon whose store went first retries it until killed)."""
        store, self.store_proc = self.store_proc, None
        try:
            super().close()
        finally:
            self.store_proc = store
            if store is not None and store.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(store.pid, signal.SIGTERM)
                try:
                    store.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(store.pid, signal.SIGKILL)
                    store.wait(10)

    def link(self, node: int, up: bool) -> None:
        """Node's veth on the hub's bridge up or down: a cut cable (everything it sends or gets is lost)."""
        assert self.emulated is not None
        subprocess.run(["ip", "-n", self.emulated.hub, "link", "set", f"h{node}", "up" if up else "down"],
                       check=True, capture_output=True)


# ------------------------------------------------------------------------------------------------ the drill
class Stop(Exception):
    """SIGTERM or SIGHUP: clean up as for Ctrl-C."""


class Drill:
    def __init__(self, args: argparse.Namespace, schedule: list[Fault], workdir: Path, say: Callable[[str], None]):
        self.args, self.schedule, self.workdir, self.say = args, schedule, workdir, say
        self.t0 = time.monotonic()
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.n, self.locals = args.nodes, args.trainers
        self.world = self.n * self.locals
        self.stop_file = workdir / "stop"
        self.logs = {(n, lr): TrainerLog(workdir / f"trainer-{n}.{lr}.jsonl") for n in range(self.n)
                     for lr in range(self.locals)}
        self.trainers: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
        self.down: set[tuple[Any, ...]] = set()  # ("daemon", n) / ("trainer", n, lr): killed by us, not back yet
        self.frozen: set[int] = set()
        self.cut: set[int] = set()
        self.finished: set[tuple[int, int]] = set()
        self.faults: list[Fault] = []
        self.pending: list[tuple[float, Fault]] = []  # (monotonic time, fault) heals to do
        self.crashes: list[str] = []
        self.daemon_exits: list[str] = []
        self.deadlocks: list[dict[str, Any]] = []
        self.last_progress = time.monotonic()
        self.stall_flagged_at: float | None = None
        self.max_step = -1
        self.shm_seen: set[str] = set()
        self.memfds_seen: set[tuple[int, int]] = set()  # (device, inode) of zend buffers our processes held
        self.daemon_memfds: dict[int, list[int]] = {}  # node -> zend memfds its daemon held: warm, at the end
        self.pool_left: dict[int, int] = {}  # node -> buffer_pool_bytes in its status once every trainer left
        self.c: DrillCluster | None = None
        self.emulated: Any = None
        # --checkpoint-every: the trainers form a gloo group (DCP's collectives) per life of the job, through a
        # store the drill hosts; any trainer's death ends the life (torchrun's restart: every trainer anew)
        self.gloo_store: Any = None
        self.life = 0
        self.job_restarts: list[dict[str, Any]] = []
        self.memory_lost_at = 0.0  # when every daemon last died at once (cluster_restart): checkpoints lost
        self.env = {**os.environ, MARKER: self.run_id,
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}

    # ----------------------------------------------------------------------------- processes
    def start_trainer(self, node: int, local: int) -> None:
        assert self.c is not None
        argv = [sys.executable, str(Path(__file__).resolve()), "trainer", "--socket-dir", self.c.socket_dir(node),
                "--log", str(self.logs[(node, local)].path), "--stop", str(self.stop_file), "--node", str(node),
                "--local", str(local), "--locals", str(self.locals), "--seed", str(self.args.seed),
                "--pause-s", str(self.args.pause_s), "--loop", self.args.trainer_loop]
        if self.args.checkpoint_every:
            argv += ["--checkpoint-every", str(self.args.checkpoint_every), "--gloo-store",
                     f"127.0.0.1:{self.gloo_store.port}", "--life", str(self.life), "--world", str(self.world)]
        err = open(self.workdir / f"trainer-{node}.{local}.err", "ab")  # noqa: SIM115 (the child owns it)
        self.trainers[(node, local)] = subprocess.Popen(
            argv, stdout=err, stderr=subprocess.STDOUT, start_new_session=True,
            env={**self.env, "ZEN_JOB_TOKEN": self.c.token(JOB)})
        err.close()

    def kill_trainer(self, node: int, local: int) -> None:
        proc = self.trainers[(node, local)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def end_life(self, why: str, first: tuple[int, int] | None = None) -> None:
        """(--checkpoint-every) Every trainer killed -9, `first` first, as torchrun's agent stops the rest of a
        job when one worker fails; what the job had delivered and held complete is recorded for the checks."""
        if first is not None:
            self.kill_trainer(*first)
        for key in self.trainers:
            self.kill_trainer(*key)
        self.read_logs()
        # what every node had reported complete (not counting reports from before every daemon died at once)
        held = {n: max((max(e["complete"], default=-1) for lr in range(self.locals)
                        for e in self.logs[(n, lr)].events if e["ev"] == "held" and e["complete"] is not None
                        and e["t"] > self.memory_lost_at), default=-1) for n in range(self.n)}
        delivered = max((e["step"] for log in self.logs.values() for e in log.oks()), default=-1)
        self.job_restarts.append({"life": self.life, "why": why, "delivered": delivered,
                                  "complete": min(held.values()), "at_s": round(time.monotonic() - self.t0, 1)})

    def new_life(self) -> None:
        self.life += 1
        self.finished.clear()  # a trainer that had finished starts again with the others
        for key in self.logs:
            self.start_trainer(*key)

    def _processes(self) -> list[int]:
        assert self.c is not None
        procs = [*self.c.procs.values(), *self.trainers.values()]
        if self.c.store_proc is not None:
            procs.append(self.c.store_proc)
        return [p.pid for p in procs if p.poll() is None]

    def sample_resources(self) -> None:
        """What our processes hold in /dev/shm and as zend memfds (checked once they are gone)."""
        for pid in self._processes():
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith("/dev/shm/"):
                            self.shm_seen.add(target.removesuffix(" (deleted)"))
                        elif target.startswith("/memfd:zend"):
                            st = os.stat(f"/proc/{pid}/fd/{fd}")
                            self.memfds_seen.add((st.st_dev, st.st_ino))

    def memfds_of(self, pid: int) -> list[str]:
        """The zend buffers (memfds) process `pid` holds, by name (zend-buffer-<id>); not
        its checkpoint memory (zend-checkpoint-<id>), which it keeps for the job once its trainers have left."""
        names = []
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/memfd:zend-buffer-"):
                        names.append(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
        return sorted(names)

    # ----------------------------------------------------------------------------- faults
    def inject(self, f: Fault) -> None:
        assert self.c is not None
        f.injected = now = time.monotonic()
        if f.kind == "daemon_restart":
            self.down.add(("daemon", f.node))
            self.c.kill(f.node)
        elif f.kind == "cluster_restart":
            self.memory_lost_at = now
            for node in self.c.procs:
                self.down.add(("daemon", node))
                self.c.send_signal(node, signal.SIGKILL)  # all at once, then reaped
            for node in self.c.procs:
                self.c.procs[node].wait(30)
        elif f.kind == "freeze":
            self.frozen.add(f.node)
            self.c.send_signal(f.node, signal.SIGSTOP)
        elif f.kind == "trainer_restart" and self.args.checkpoint_every:
            if any(k[0] == "trainer" for k in self.down):  # the job is down already, restarting for another fault
                f.note = "the job was already restarting"
            else:
                self.down.update(("trainer", *key) for key in self.logs)
                self.end_life(f"fault #{f.index}", first=(f.node, f.local))
        elif f.kind == "trainer_restart":
            self.down.add(("trainer", f.node, f.local))
            self.kill_trainer(f.node, f.local)
        elif f.kind == "partition":
            self.cut.add(f.node)
            self.c.link(f.node, up=False)
        self.faults.append(f)
        self.pending.append((now + f.hold_s, f))
        self.say(f"  {f.describe()}  [injected at {now - self.t0:.1f} s]")

    def heal(self, f: Fault) -> None:
        assert self.c is not None
        if f.kind == "daemon_restart":
            self.c.start_node(f.node)
            self.down.discard(("daemon", f.node))
        elif f.kind == "cluster_restart":
            for node in list(self.c.procs):
                self.c.start_node(node)
                self.down.discard(("daemon", node))
        elif f.kind == "freeze":
            self.c.send_signal(f.node, signal.SIGCONT)
            self.frozen.discard(f.node)
        elif f.kind == "trainer_restart" and self.args.checkpoint_every:
            if not any(g.kind == "trainer_restart" for _, g in self.pending):  # the last one down starts the job
                self.new_life()
                self.down.difference_update(("trainer", *key) for key in self.logs)
        elif f.kind == "trainer_restart":
            self.start_trainer(f.node, f.local)
            self.down.discard(("trainer", f.node, f.local))
        elif f.kind == "partition":
            self.c.link(f.node, up=True)
            self.cut.discard(f.node)
        f.healed = time.monotonic()

    def heal_due(self, everything: bool = False) -> None:
        now = time.monotonic()
        for item in sorted(self.pending, key=lambda p: p[0]):
            if everything or item[0] <= now:
                self.pending.remove(item)
                self.heal(item[1])

    # ----------------------------------------------------------------------------- watching
    def poll(self, phase: str) -> None:
        """Read the trainers' logs, answer exits we did not cause as a supervisor would, watch for a stall."""
        assert self.c is not None
        self.read_logs()
        for node, proc in self.c.procs.items():
            if ("daemon", node) not in self.down and proc.poll() is not None:
                at = time.monotonic() - self.t0
                self.daemon_exits.append(f"node {node}'s daemon (pid {proc.pid}) exited with {proc.returncode} "
                                         f"at {at:.1f} s; its log:\n{self.c.log_tail(node, 15)}")
                self.say(f"  ! node {node}'s daemon exited on its own ({proc.returncode}): started again")
                self.c.start_node(node)
        for key, proc in self.trainers.items():
            if ("trainer", *key) in self.down or key in self.finished or proc.poll() is None:
                continue
            if proc.returncode == 0 and phase == "final":
                self.finished.add(key)
                continue
            left_behind = self.args.checkpoint_every and proc.returncode == LEFT_BEHIND  # not a crash: a restart
            if proc.returncode != 3 and not left_behind:  # 3: it said why in its log (a crash event)
                tail = (self.workdir / f"trainer-{key[0]}.{key[1]}.err").read_text(errors="replace")[-1500:]
                self.crashes.append(f"trainer {key[0]}.{key[1]} (pid {proc.pid}) exited with {proc.returncode}:\n"
                                    f"{tail}")
            if self.args.checkpoint_every:  # its life's group is broken: the job restarts, as under torchrun
                what = "lost a result (OutOfOrder)" if left_behind else f"exited on its own ({proc.returncode})"
                self.say(f"  {'' if left_behind else '! '}trainer {key[0]}.{key[1]} {what}: the job restarts")
                self.end_life(f"trainer {key[0]}.{key[1]} {what}")
                self.new_life()
                return
            self.say(f"  ! trainer {key[0]}.{key[1]} exited on its own ({proc.returncode}): started again")
            self.start_trainer(*key)
        now = time.monotonic()
        if (phase != "warm-up" and now - self.last_progress > self.args.stall_s
                and self.stall_flagged_at != self.last_progress):
            self.stall_flagged_at = self.last_progress
            self.report_deadlock(phase)

    def read_logs(self) -> None:
        """The trainers' new events: progress, and crashes (the only reader: an event is seen once)."""
        for key, log in self.logs.items():
            for e in log.read():
                if e["ev"] == "ok":
                    self.last_progress = max(self.last_progress, e["t"])
                    self.max_step = max(self.max_step, e["step"])
                elif e["ev"] == "crash":
                    self.crashes.append(f"trainer {key[0]}.{key[1]} (pid {e['pid']}) at step {e['step']}: "
                                        f"{e['kind']}: {e['msg']}")

    def report_deadlock(self, phase: str) -> None:
        since = time.monotonic() - self.last_progress
        self.say(f"  ! DEADLOCK: no trainer delivered a step for {since:.0f} s (phase {phase}, job at step "
                 f"{self.max_step}); asking every daemon (`zend status --json`)")
        statuses, stacks = self.statuses(), self.stacks()
        now = time.monotonic()
        last_words = {f"{n}.{lr}": log.events[-3:] for (n, lr), log in self.logs.items()}
        record = {"at_s": round(now - self.t0, 1), "phase": phase, "stalled_s": round(since, 1),
                  "max_step": self.max_step, "status": statuses, "trainers": last_words, "stacks": stacks,
                  "faults_active": [f.describe() for _, f in self.pending]}
        self.deadlocks.append(record)
        (self.workdir / f"deadlock-{len(self.deadlocks)}.json").write_text(json.dumps(record, indent=1))
        for node, st in statuses.items():
            self.say(f"    node {node}: {status_line(st)}")
        for key, events in last_words.items():
            quiet = f"{now - events[-1]['t']:.0f} s" if events else "ever"
            self.say(f"    trainer {key}: silent for {quiet}, in {stacks.get(key, '?')}; last: "
                     + " | ".join(event_line(e)[:300] for e in events))

    def stacks(self) -> dict[str, str]:
        """Where each trainer is (faulthandler's dump on SIGUSR1): its innermost frames in zen and zend."""
        marks = {}
        for key, proc in self.trainers.items():
            if not any(e["pid"] == proc.pid for e in self.logs[key].events):
                continue  # not logging yet: SIGUSR1 might come before its handler and kill it
            err = self.workdir / f"trainer-{key[0]}.{key[1]}.err"
            marks[key] = err.stat().st_size if err.exists() else 0
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = {}
        for key, mark in marks.items():
            with open(self.workdir / f"trainer-{key[0]}.{key[1]}.err", "rb") as f:
                f.seek(mark)
                dump = f.read().decode(errors="replace")
            main = dump.split("Current thread")[-1] if "Current thread" in dump else dump
            frames = [f"{Path(m[1]).name}:{m[2]}" for m in re.finditer(r'File "([^"]+)", line \d+ in (\S+)', main)
                      if "/zen/" in m[1] or "/zend/" in m[1]]
            out[f"{key[0]}.{key[1]}"] = " < ".join(frames[:4]) or "(no stack: not running?)"
        return out

    def statuses(self) -> dict[int, Any]:
        """`zend status --json` of every daemon, side by side (a frozen one answers nothing in 10 s)."""
        assert self.c is not None
        out: dict[int, Any] = {}

        def ask(node: int) -> None:
            assert self.c is not None
            try:
                run = subprocess.run([sys.executable, "-m", "zend", "status", "--json", "--socket-dir",
                                      self.c.socket_dir(node), "--secret-file", str(self.c.secret_file)],
                                     capture_output=True, text=True, timeout=30, env=self.env)
                out[node] = json.loads(run.stdout) if run.returncode == 0 else (run.stderr or run.stdout).strip()
            except (subprocess.TimeoutExpired, ValueError) as exc:
                out[node] = f"no answer: {exc}"

        threads = [threading.Thread(target=ask, args=(n,)) for n in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return dict(sorted(out.items()))

    def wait(self, until: Callable[[], bool], timeout_s: float, phase: str) -> bool:
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
            self.heal_due()
            self.poll(phase)
        return True

    # ----------------------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        a = self.args
        self.t0 = time.monotonic()
        extra = ["--log-format", "text", "--peer-timeout-s", str(a.peer_timeout_s), *a.daemon_arg]
        if not a.loopback:
            from zend.cluster.netns import EmulatedCluster

            self.emulated = EmulatedCluster(self.n + 1).__enter__()  # host n: the store's
        self.c = DrillCluster(self.n, self.workdir, self.emulated, extra=extra, env={MARKER: self.run_id},
                              metrics=False, ready_timeout_s=120)
        self.c.__enter__()
        if a.checkpoint_every:
            import datetime

            self.gloo_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                                         timeout=datetime.timedelta(seconds=120))
        self.say(f"cluster up in {time.monotonic() - self.t0:.1f} s: {self.n} daemons ("
                 f"{'loopback' if a.loopback else 'network namespaces ' + self.emulated.prefix + '-*'}), store "
                 f"{self.c.store}; starting {self.world} trainers")
        for key in self.logs:
            self.start_trainer(*key)
        self.last_progress = time.monotonic()
        started = self.wait(lambda: all(any(e["step"] >= 3 for e in log.oks()) for log in self.logs.values()),
                            180, "warm-up")
        if not started:
            raise RuntimeError("the trainers did not get to step 3 within 180 s; see " + str(self.workdir))
        self.sample_resources()
        self.daemon_memfds = {n: [len(self.memfds_of(p.pid))] for n, p in self.c.procs.items()}
        self.t0 = t0 = time.monotonic()
        rate0 = self.max_step
        self.say(f"faults for {a.duration_s:g} s from step {self.max_step}")
        plan = list(self.schedule)
        last_sample = t0
        while time.monotonic() - t0 < a.duration_s:
            if self.deadlocks:
                self.say("  a deadlock: no more faults; healing everything")
                break
            now = time.monotonic()
            while plan and t0 + plan[0].at_s <= now:
                self.inject(plan.pop(0))
            self.heal_due()
            self.poll("faults")
            if now - last_sample > 2:
                self.sample_resources()
                last_sample = now
            time.sleep(0.05)
        fault_phase_s, steps_under_faults = time.monotonic() - t0, self.max_step - rate0
        self.say(f"faults over after {fault_phase_s:.1f} s ({len(self.faults)} injected, job at step "
                 f"{self.max_step}, {(self.max_step - rate0) / fault_phase_s:.1f} steps/s); healing, then a last step")
        self.heal_due(everything=True)
        healed_at = time.monotonic()
        # every trainer delivers again, then all are told the same last step
        again = self.wait(lambda: all(any(e["t"] > healed_at for e in log.oks()) for log in self.logs.values()),
                          a.stall_s + 10, "final")
        target = None
        if again:
            rate = max(1.0, steps_under_faults / fault_phase_s)
            target = self.max_step + int(2 * rate) + 20  # far enough ahead that no trainer is past it yet
            tmp = self.stop_file.with_suffix(".tmp")
            tmp.write_text(str(target))
            tmp.rename(self.stop_file)
            self.say(f"every trainer delivers again; stopping all at step {target}")
            done = self.wait(lambda: len(self.finished) == len(self.logs), a.stall_s + 30, "final")
            if not done:
                self.say("  ! not every trainer reached the last step")
        else:
            self.say("  ! the job did not deliver again after every fault was healed")
        self.sample_resources()
        sessions, memfds = dict[int, int](), dict[int, list[str]]()
        if again and len(self.finished) == len(self.logs):  # every trainer left: the daemons hold nothing of theirs
            sessions = self.sessions_left()
            for _ in range(25):  # a buffer closed a moment after its session
                memfds = {n: k for n, p in self.c.procs.items() if (k := self.memfds_of(p.pid))}
                if not memfds:
                    break
                time.sleep(0.2)
        for n, p in self.c.procs.items():
            self.daemon_memfds.setdefault(n, []).append(len(self.memfds_of(p.pid)))
        return {"target": target, "sessions_left": sessions, "memfds_left": memfds, "fault_phase_s": fault_phase_s,
                "steps_in_fault_phase": steps_under_faults}

    def sessions_left(self) -> dict[int, int]:
        """Sessions each daemon still holds once every trainer has exited (it should have closed them)."""
        deadline, left = time.monotonic() + 15, dict[int, int]()
        while time.monotonic() < deadline:
            left = {}
            for node, st in self.statuses().items():
                count = st.get("session_count", 0) if isinstance(st, dict) else -1
                if isinstance(st, dict):
                    self.pool_left[node] = st.get("buffer_pool_bytes", 0)
                if count:
                    left[node] = count
            if not left:
                return {}
            time.sleep(1)
        return left

    def close(self) -> None:
        """Everything this run started, stopped, whatever happened (also after Ctrl-C)."""
        for key, proc in self.trainers.items():
            if proc.poll() is None:
                self.kill_trainer(*key)
        if self.c is not None:
            for node in range(self.n):
                self.c.send_signal(node, signal.SIGCONT)  # a frozen daemon would not see SIGTERM
            for node in list(self.cut):
                with contextlib.suppress(subprocess.CalledProcessError):
                    self.c.link(node, up=True)
            self.c.close()
        if self.emulated is not None:
            self.emulated.__exit__(None, None, None)


# --------------------------------------------------------------------------------------------------- checks
def status_line(st: Any) -> str:
    if not isinstance(st, dict):
        return str(st)[:300]
    tensors = ", ".join(f"{t['name']} last step {t['last_step']} ({t['steps']} steps)" for t in st.get("tensors", []))
    peers = ",".join(f"{p['rank']}{'' if p['connected'] else '(down)'}" for p in st.get("peers", []))
    reason = f" ({st['state_reason']})" if st.get("state_reason") else ""
    return (f"state {st.get('state') or 'serving'}{reason}, generation {st.get('generation')}, "
            f"{st.get('node_count')} nodes, peers [{peers}], {st.get('steps_in_flight')} steps in flight, "
            f"{st.get('session_count')} sessions; {tensors or 'no tensors'}"
            f"; last change: {st.get('last_membership_change', '')[:200]}")


def event_line(e: dict[str, Any]) -> str:
    rest = {k: v for k, v in e.items() if k not in ("t", "ev", "pid", "hash")}
    return f"{e['ev']} " + " ".join(f"{k}={v}" for k, v in rest.items())


def check_results(logs: dict[tuple[int, int], TrainerLog], seed: int, world: int,
                  target: int | None) -> dict[str, dict[str, Any]]:
    """The checks on what the trainers got: sums, split steps, the last step, resume points, skipped steps."""
    by_step: dict[int, dict[str, list[str]]] = {}
    for (n, lr), log in logs.items():
        for e in log.oks():
            by_step.setdefault(e["step"], {}).setdefault(e["hash"], []).append(f"{n}.{lr}")
    wrong, split = [], []
    refs: dict[int, tuple[str, int, list[int]]] = {}
    for step in sorted(by_step):
        refs[step] = reference(seed, world, step)
        if len(by_step[step]) > 1:
            split.append(f"step {step}: " + "; ".join(f"{h} on {','.join(who)}" for h, who in by_step[step].items()))
    for (n, lr), log in logs.items():
        for e in log.oks():
            ref_hash, ref_total, per_rank = refs[e["step"]]
            if e["hash"] != ref_hash:
                off = e["total"] - ref_total
                guess = [f"rank {r} {'missing' if off == -t else 'twice'}" for r, t in enumerate(per_rank)
                         if t and off in (t, -t)]
                wrong.append(f"trainer {n}.{lr} step {e['step']}: got {e['hash']} (total {e['total']}), want "
                             f"{ref_hash} (total {ref_total}){'; ' + ' or '.join(guess) if guess else ''}")
    finals = {f"{n}.{lr}": next((e["step"] for e in reversed(log.events) if e["ev"] == "done"), None)
              for (n, lr), log in logs.items()}
    final_ok = target is not None and all(s == target for s in finals.values())
    # a trainer that (re)starts, or resumes after OutOfOrder, at step J: no step >= J may have been delivered
    # before (each needs this trainer's submission of J first): else it was told a step behind the job
    oks = sorted((e["t"], e["step"]) for log in logs.values() for e in log.oks())
    behind = []
    for (n, lr), log in logs.items():
        for e in log.events:
            if e["ev"] not in ("start", "resume"):
                continue
            told = e["step"] if e["ev"] == "start" else e["to"]
            done = max((s for t, s in oks if t < e["t"]), default=-1)
            if done >= told:
                behind.append(f"trainer {n}.{lr} (pid {e['pid']}) {e['ev']} at step {told}, but the job had "
                              f"delivered step {done} already")
    last = max(by_step, default=-1)
    skipped = [s for s in range(last + 1) if s not in by_step]
    return {
        "wrong_sums": {"ok": not wrong, "count": len(wrong), "details": wrong[:20]},
        "split_steps": {"ok": not split, "count": len(split), "details": split[:20]},
        "final_step": {"ok": final_ok, "target": target, "details": [f"trainer {k}: {v}" for k, v in finals.items()]},
        "resumed_behind": {"ok": not behind, "count": len(behind), "details": behind[:20]},
        "skipped_steps": {"ok": not skipped, "count": len(skipped), "details": [str(s) for s in skipped[:50]]},
        "checked": {"ok": True, "steps": len(by_step),
                    "trainer_steps": sum(len(log.oks()) for log in logs.values())},
    }


def check_checkpoints(logs: dict[tuple[int, int], TrainerLog], job_restarts: list[dict[str, Any]]) -> dict[str, Any]:
    """(--checkpoint-every) Each life of the job restored exactly the model its checkpoint step had (the digest the
    trainers logged after that step), the same step on every trainer, and no older than the newest step every
    node had reported complete before the job was killed: the work lost per restart is at most the iterations
    since the last complete checkpoint."""
    params: dict[int, set[str]] = {}
    for log in logs.values():
        for e in log.oks():
            if "param" in e:
                params.setdefault(e["step"], set()).add(e["param"])
    problems = [f"step {step}: the trainers' models differ ({len(p)} digests)" for step, p in params.items()
                if len(p) > 1]
    restored: dict[int, set[Any]] = {}
    seconds = []
    for (n, lr), log in logs.items():
        for e in log.events:
            if e["ev"] != "restore":
                continue
            restored.setdefault(e["life"], set()).add(e["step"])
            if "seconds" in e:
                seconds.append(e["seconds"])
            k = e["step"]
            if k is None:
                if e["param"] != digest(torch.zeros(NUM_ROWS, DIM)):
                    problems.append(f"trainer {n}.{lr} life {e['life']}: nothing restored, yet its model is not zero")
            elif e["param"] not in params.get(k, set()):
                problems.append(f"trainer {n}.{lr} life {e['life']}: restored step {k} as {e['param']}, but after "
                                f"step {k} the model was {sorted(params.get(k, {'never delivered'}))}")
    for life, steps in restored.items():
        if len(steps) > 1:
            problems.append(f"life {life}: the trainers restored different steps {sorted(steps, key=str)}")
    lost = []
    for r in job_restarts:
        steps = restored.get(r["life"] + 1, set())
        r["since_complete"] = r["delivered"] - r["complete"]
        if not steps:  # the next life was killed (or the run ended) before any trainer had restored
            r["restored"] = r["lost"] = None
            continue
        k = -1 if None in steps else max(steps)
        r["restored"], r["lost"] = (None if k < 0 else k), r["delivered"] - k
        lost.append(r["lost"])
        if k < r["complete"]:
            problems.append(f"life {r['life'] + 1} restored step {None if k < 0 else k}, but step {r['complete']} was "
                            f"complete on every node before life {r['life']} ended ({r['why']}): {r['lost']} "
                            f"iterations lost, {r['since_complete']} since the last complete checkpoint")
    return {"ok": not problems, "count": len(problems), "details": problems[:20], "restarts": job_restarts,
            "lost": lost, "restore_s": seconds}


def measure_recovery(faults: list[Fault], logs: dict[tuple[int, int], TrainerLog], end: float) -> None:
    """Per fault, detect: from the fault to the last trainer's first error (None: nobody saw one, the
    fault was absorbed); recover: from the heal until every trainer has delivered a step again."""
    for i, f in enumerate(faults):
        if f.injected is None or f.healed is None:
            continue
        nxt = faults[i + 1].injected if i + 1 < len(faults) and faults[i + 1].injected else end
        firsts, f.errors = [], 0
        for log in logs.values():
            seen = [e["t"] for e in log.events
                    if e["ev"] in ("error", "resume", "crash", "behind") and f.injected <= e["t"] < nxt]
            f.errors += len(seen)
            if seen:
                firsts.append(seen[0])
        f.detect_s = round(max(firsts) - f.injected, 3) if firsts else None
        healed = f.healed
        backs = [next((e["t"] for e in log.oks() if e["t"] > healed), None) for log in logs.values()]
        if all(b is not None for b in backs):
            back = max(b for b in backs if b is not None)
            f.recover_s = round(back - f.healed, 3)
            f.overlapped = back > nxt


def leaks(run_id: str, prefix: str | None, shm_seen: set[str], memfds_seen: set[tuple[int, int]],
          sessions_left: dict[int, int], memfds_left: dict[int, list[str]],
          pool_left: dict[int, int]) -> dict[str, Any]:
    """What the run left: processes (by the marker in their environment), namespaces, /dev/shm files,
    zend memfds anyone still holds; and what daemons kept once every trainer had left (sessions, buffers)."""
    needle = f"{MARKER}={run_id}".encode()
    procs: list[str] = []
    for _ in range(50):  # processes SIGKILLed a moment ago may still be going
        procs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    procs.append(f"pid {pid}: {cmd[:200]}")
        if not procs:
            break
        time.sleep(0.1)
    namespaces = []
    if prefix:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        namespaces = [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]
    shm = sorted(p for p in shm_seen if os.path.exists(p))
    memfds = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (st.st_dev, st.st_ino) in memfds_seen:
                        memfds.append(f"pid {pid} fd {fd}: {os.readlink(f'/proc/{pid}/fd/{fd}')}")
    sessions = [f"node {n}: {k} sessions after every trainer left" for n, k in sessions_left.items()]
    sessions += [f"node {n}: its daemon holds {len(k)} zend memfds after every trainer left ({', '.join(k[:6])}; "
                 f"status: buffer_pool_bytes {pool_left.get(n)})" for n, k in memfds_left.items()]
    found = procs + namespaces + shm + memfds + sessions
    return {"ok": not found, "count": len(found), "processes": procs, "namespaces": namespaces, "dev_shm": shm,
            "memfds": memfds, "sessions": sessions}


def summarize(faults: list[Fault]) -> dict[str, dict[str, Any]]:
    def spread(xs: list[float]) -> dict[str, float] | None:
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else None

    out = {}
    for kind in KINDS + EXTRA_KINDS:
        fs = [f for f in faults if f.kind == kind]
        if not fs:
            continue
        detected = [f.detect_s for f in fs if f.detect_s is not None]
        recovered = [f.recover_s for f in fs if f.recover_s is not None]
        out[kind] = {"count": len(fs), "detected": len(detected), "detect_s": spread(detected),
                     "recover_s": spread(recovered), "overlapped": sum(f.overlapped for f in fs),
                     "errors_median": statistics.median(f.errors for f in fs), "errors_max": max(f.errors for f in fs),
                     "not_recovered": sum(f.recover_s is None for f in fs)}
    return out


def print_report(r: dict[str, Any]) -> None:
    def fmt(s: dict[str, float] | None) -> str:
        return f"{s['min']:6.2f} {s['median']:6.2f} {s['max']:6.2f}" if s else f"{'-':>6} {'-':>6} {'-':>6}"

    where = "loopback" if r["loopback"] else "namespaces"
    print(f"\nfault drill: {r['nodes']} nodes x {r['trainers']} trainers, {where}, seed {r['seed']}, "
          f"{r['fault_phase_s']:.0f} s of faults, {r['steps_in_fault_phase']} steps under them, "
          f"{r['wall_s']:.0f} s in all")
    print("recovery, seconds (detect: fault -> last trainer's first error; recover: heal -> every trainer delivers; "
          "errors: failed attempts all trainers saw, per fault)")
    print(f"{'fault':<16} {'count':>5} {'seen':>5}  {'detect min/med/max':>20}  {'recover min/med/max':>20}  "
          f"{'errors med/max':>15}  notes")
    for kind, s in r["recovery"].items():
        notes = []
        if s["overlapped"]:
            notes.append(f"{s['overlapped']} still recovering when the next fault came (its time counts)")
        if s["not_recovered"]:
            notes.append(f"{s['not_recovered']} never recovered")
        errors = f"{s['errors_median']:g}/{s['errors_max']}"
        print(f"{kind:<16} {s['count']:>5} {s['detected']:>5}  {fmt(s['detect_s']):>20}  {fmt(s['recover_s']):>20}  "
              f"{errors:>15}  " + "; ".join(notes))
    print()
    for name, c in r["checks"].items():
        if name == "checked":
            continue
        count = c.get("count", 0 if c["ok"] else 1)
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {name}: {count}")
        if not c["ok"]:
            for line in c.get("details", [])[:8]:
                print(f"       {line}")
    ckpt = r["checks"].get("checkpoints")
    if ckpt is not None:
        lost, secs = ckpt["lost"], ckpt["restore_s"]
        print(f"in-memory checkpoints every {r['checkpoint_every']} steps: {len(ckpt['restarts'])} job restarts; "
              f"iterations lost per restart {lost or '-'} (since the last complete checkpoint: "
              f"{[x['since_complete'] for x in ckpt['restarts']] or '-'}); restore "
              + (f"{min(secs):.2f}-{max(secs):.2f} s" if secs else "-"))
    checked = r["checks"]["checked"]
    print(f"checked {checked['trainer_steps']} delivered results of {checked['steps']} steps; "
          f"{'PASS' if r['ok'] else 'FAIL'} (seed {r['seed']}; logs: {r['workdir'] or 'removed'})")
    if not r["ok"]:
        print(f"replay: {r['replay']}")


# ------------------------------------------------------------------------------------------------------ main
def parse_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    return float(low), float(high or low)


def replay_command(args: argparse.Namespace) -> str:
    every = f"{args.fault_every_s[0]:g}-{args.fault_every_s[1]:g}"
    return (f"python benchmarks/fault_drill.py --nodes {args.nodes} --trainers {args.trainers} --duration-s "
            f"{args.schedule_duration_s:g} --fault-every-s {every} --faults {','.join(args.kinds)} --seed {args.seed}"
            + (" --loopback" if args.loopback else "") + (f" --only {args.only_text}" if args.only_text else "")
            + (f" --trainer-loop {args.trainer_loop}" if args.trainer_loop != "readme" else "")
            + "".join(f" --daemon-arg={d}" for d in args.daemon_arg)
            + (f" --peer-timeout-s {args.peer_timeout_s:g}" if args.peer_timeout_s != 5.0 else "")
            + (f" --checkpoint-every {args.checkpoint_every}" if args.checkpoint_every else ""))


def _indices(part: str) -> range:
    low, _, high = part.partition("-")
    return range(int(low), int(high or low) + 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--trainers", type=int, default=2, help="trainer processes per node")
    p.add_argument("--duration-s", type=float, default=120.0, help="how long faults come")
    p.add_argument("--fault-every-s", type=parse_range, default=(6.0, 10.0), metavar="LOW-HIGH")
    p.add_argument("--faults", default=",".join(KINDS),
                   help=f"a comma-separated subset of {','.join(KINDS + EXTRA_KINDS)} (default: {','.join(KINDS)})")
    p.add_argument("--seed", type=int, default=None, help="the schedule's and the gradients' (default: random)")
    p.add_argument("--only", default=None, metavar="I,J-K",
                   help="only these faults of the seed's schedule (by #), spaced as there, the first 6 s in: a "
                        "shorter replay of what went wrong")
    p.add_argument("--loopback", action="store_true", help="no namespaces (no root needed); no partitions")
    p.add_argument("--peer-timeout-s", type=float, default=5.0, help="the daemons' (their default: 5)")
    p.add_argument("--stall-s", type=float, default=60.0, help="no step for this long is a deadlock")
    p.add_argument("--pause-s", type=float, default=0.02, help="a trainer's pause between steps")
    p.add_argument("--trainer-loop", choices=["readme", "helper"], default="readme",
                   help="readme: the README's loop (StepAborted/DaemonUnavailable: wait_ready, redo, as often as "
                        "it takes); helper: zen.step_surviving_faults (5 redos, then the error is a crash)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="the trainers keep a model (every result summed), checkpoint it in memory every K steps "
                        "(zen.checkpoint, DCP's async_save on a gloo group per life of the job), and a trainer's "
                        "death restarts the whole job, which resumes from the newest complete checkpoint, as "
                        "under torchrun; checked: the restored model bit for bit, and the work lost")
    p.add_argument("--daemon-arg", action="append", default=[], help="one more flag for every zend serve")
    p.add_argument("--keep", action="store_true", help="keep the logs also when every check passes")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout (progress on stderr)")
    args = p.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS + EXTRA_KINDS))
    if unknown:
        p.error(f"--faults: unknown {unknown}; known: {','.join(KINDS + EXTRA_KINDS)}")
    args.notes = []
    if args.loopback and "partition" in kinds:
        kinds.remove("partition")
        args.notes.append("--loopback: no partitions (they need network namespaces)")
    if not args.loopback:
        from zend.cluster.netns import available

        reason = available()
        if reason:
            p.error(f"network namespaces: {reason}; --loopback runs without them (and without partitions)")
    if not kinds:
        p.error("no fault kind left to inject")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every {args.checkpoint_every}: must be 0 (none) or more")
    if args.nodes < 2 or args.trainers < 1:
        p.error("--nodes must be at least 2 and --trainers at least 1")
    args.kinds = kinds
    args.only_text, args.only = args.only, None
    if args.only_text:
        try:
            args.only = {i for part in args.only_text.split(",") for i in _indices(part)}
        except ValueError:
            p.error(f"--only {args.only_text!r}: expected fault numbers such as 3,5-7")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    return args


@contextlib.contextmanager
def signals(ignore: bool = False) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise Stop, and the run cleans up (SIGINT too when a shell started us in
    the background with it ignored); with `ignore` they are ignored (while cleaning up: a second Ctrl-C
    must not leave namespaces or daemons behind)."""
    def stop(signum: int, _frame: Any) -> None:
        raise Stop(signal.Signals(signum).name)

    which = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN if ignore else stop) for s in which}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "trainer":
        return trainer_main(sys.argv[2:])
    args = parse_args(argv)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    schedule, skipped = make_schedule(args.seed, args.duration_s, args.fault_every_s, args.kinds, args.nodes,
                                      args.trainers)
    args.schedule_duration_s = args.duration_s  # what the schedule was drawn for (a replay draws it again)
    if args.only is not None:  # a part of the seed's schedule, its spacing kept, the first fault 6 s in
        schedule = [f for f in schedule if f.index in args.only]
        if not schedule:
            say(f"--only {args.only_text}: the seed's schedule has no such faults")
            return 2
        shift = schedule[0].at_s - 6.0
        for f in schedule:
            f.at_s = round(f.at_s - shift, 2)
        args.duration_s = min(args.duration_s, max(f.at_s + f.hold_s for f in schedule) + 15)
    say(f"fault drill, seed {args.seed}: {args.nodes} nodes x {args.trainers} trainers, faults "
        f"{','.join(args.kinds)} every {args.fault_every_s[0]:g}-{args.fault_every_s[1]:g} s for {args.duration_s:g} s")
    for note in args.notes:
        say(f"  note: {note}")
    say(f"schedule (replay: {replay_command(args)}):")
    for f in schedule:
        say(f"  {f.describe()}")
    for s in skipped:
        say(f"  skipped: {s}")
    workdir = Path(tempfile.mkdtemp(prefix="zdrill-"))
    drill = Drill(args, schedule, workdir, say)
    started, outcome, error = time.monotonic(), {}, None
    try:
        with signals():
            outcome = drill.run()
    except (KeyboardInterrupt, Stop) as exc:
        error = f"interrupted ({type(exc).__name__} {exc})"
        say(f"  ! {error}: cleaning up")
    except Exception as exc:  # the report still comes, and the cleanup
        error = f"{type(exc).__name__}: {exc}"
        say(f"  ! the drill failed: {error}")
    finally:
        end = time.monotonic()
        with signals(ignore=True):
            drill.close()
    prefix = drill.emulated.prefix if drill.emulated is not None else None
    checks = check_results(drill.logs, args.seed, drill.world, outcome.get("target"))
    checks["deadlocks"] = {"ok": not drill.deadlocks, "count": len(drill.deadlocks),
                           "details": [f"at {d['at_s']} s ({d['phase']}): no step for {d['stalled_s']} s, job at step "
                                       f"{d['max_step']}; " + " / ".join(f"node {n}: {status_line(s)}"
                                                                         for n, s in d["status"].items())
                                       for d in drill.deadlocks]}
    checks["crashes"] = {"ok": not drill.crashes, "count": len(drill.crashes), "details": drill.crashes[:20]}
    checks["daemon_exits"] = {"ok": not drill.daemon_exits, "count": len(drill.daemon_exits),
                              "details": drill.daemon_exits[:10]}
    checks["leaks"] = leaks(drill.run_id, prefix, drill.shm_seen, drill.memfds_seen, outcome.get("sessions_left", {}),
                            outcome.get("memfds_left", {}), drill.pool_left)
    checks["leaks"]["details"] = [*checks["leaks"]["processes"], *checks["leaks"]["namespaces"],
                                  *checks["leaks"]["dev_shm"], *checks["leaks"]["memfds"], *checks["leaks"]["sessions"]]
    if args.checkpoint_every:
        checks["checkpoints"] = check_checkpoints(drill.logs, drill.job_restarts)
    if error:
        checks["drill"] = {"ok": False, "count": 1, "details": [error]}
    measure_recovery(drill.faults, drill.logs, end)
    ok = all(c["ok"] for c in checks.values())
    if ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"ok": ok, "seed": args.seed, "replay": replay_command(args), "nodes": args.nodes,
              "trainers": args.trainers, "loopback": args.loopback,
              "kinds": args.kinds, "notes": args.notes, "duration_s": args.duration_s,
              "checkpoint_every": args.checkpoint_every,
              "fault_every_s": list(args.fault_every_s), "wall_s": round(time.monotonic() - started, 1),
              "fault_phase_s": outcome.get("fault_phase_s", 0.0),
              "steps_in_fault_phase": outcome.get("steps_in_fault_phase", 0), "target_step": outcome.get("target"),
              "recovery": summarize(drill.faults), "checks": checks,
              "faults": [{k: v for k, v in asdict(f).items() if k not in ("injected", "healed")} for f in drill.faults],
              "skipped": skipped, "daemon_memfds": drill.daemon_memfds, "deadlocks": drill.deadlocks,
              "workdir": None if ok and not args.keep else str(workdir)}
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
