"""Every node the same outcome, under faults: random schedules of a node stopping (kill -9) at any
send or receive of a step, commit included, of a node pausing (a straggler), and of a trainer
leaving before it submits. Four in-process nodes, each wired as the daemon wires it (test_node_steps'
Node), over a network model whose lost node's messages stop where it stopped.

For every schedule: the trainers of the nodes still up either all get the same bits (the full sum)
or all get the same error; nothing is left in a live node's mailboxes or step table."""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from zen.fused_rows import pack, table_of, unpack
from zen.fusion import batches

from tests.core.helpers import assert_close_to, reference_sum
from tests.daemon.test_node_steps import JOB, Node, grad_of
from tests.faults import FaultPlan
from tests.helpers import poll_for
from zend.core.sparse import SparseGrad
from zend.daemon import errors as codes
from zend.daemon import node_steps
from zend.daemon.errors import StepError
from zend.daemon.steps import StepKey
from zend.protocol.layout import TensorSpec
from zend.transport.inproc import InProcessCluster

pytestmark = pytest.mark.inprocess

NODES, TRAINERS = 4, 2


@dataclass(frozen=True)
class Schedule:
    kind: str  # "none", "kill" (the node stops at its op-th send or recv), "pause" (it sleeps there),
    # "leave" (a trainer leaves after its partner submitted), "leave_early" (before)
    node: int = 0
    op: int = 0
    pause_s: float = 0.0


def plan_of(schedule: Schedule) -> FaultPlan:
    """The data-plane faults of a schedule (tests/faults.py): a node stopped as kill -9 would stop it
    (what it sent before is delivered, nothing after; its peers' receives from it fail once their
    mailbox is empty, their sends to it fail), or a node that pauses at one operation. A trainer that
    leaves is no data-plane fault: run_step does it."""
    plan = FaultPlan(NODES)
    if schedule.kind == "kill":
        plan.kill(schedule.node, nth=schedule.op)
    elif schedule.kind == "pause":
        plan.delay(schedule.node, seconds=schedule.pause_s, nth=schedule.op)
    return plan


def run_step(fault: Schedule, scheme: str, step: int = 0, spec: TensorSpec | None = None,
             part: Callable[[int], SparseGrad] | None = None) -> tuple[FaultPlan, InProcessCluster, list[Node],
                                                                    list[list[object]]]:
    """One step of tensor 'emb' (or `spec`, trainer i giving part(i)) on every trainer of every node
    under `fault`; outcomes[node][trainer]."""
    net, cluster = plan_of(fault), InProcessCluster(NODES)
    spec = spec or TensorSpec(JOB, "emb", (300, 4), "float32", "sparse_rows", False)
    part = part or (lambda i: grad_of(i, step, rows=300))
    nodes = [Node(net.wrap(cluster.communicator(r)), scheme, timeout_s=10.0) for r in range(NODES)]
    sessions = [[n.trainer(t, TRAINERS) for t in range(TRAINERS)] for n in nodes]
    outcomes: list[list[object]] = [[None] * TRAINERS for _ in range(NODES)]
    left = threading.Event()

    def trainer(r: int, t: int) -> None:
        node, session = nodes[r], sessions[r][t]
        if fault.kind == "leave_early" and r == fault.node and t == 0:
            assert left.wait(30)  # its partner left before it came: the step cannot start, and fails at once
        if fault.kind in ("leave", "leave_early") and (r, t) == (fault.node, 1):
            if fault.kind == "leave":  # its partner has submitted: the step is open, waiting for this trainer
                poll_for(lambda: node.trainer_steps.in_flight(), 30, f"node {r}'s step opened by local rank 0")
            node.registry.close_session(session.session_id)
            node.trainer_steps.session_closed(session)
            outcomes[r][t] = "left"
            left.set()
            return
        try:
            outcomes[r][t] = node.submit(session, spec, part(r * TRAINERS + t), step)
        except StepError as exc:
            outcomes[r][t] = exc

    threads = [threading.Thread(target=trainer, args=(r, t)) for r in range(NODES) for t in range(TRAINERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), f"a trainer still waits under {fault}"
    return net, cluster, nodes, outcomes


def clean_ops(scheme: str, **step: object) -> list[int]:
    net, _, _, outcomes = run_step(Schedule("none"), scheme, **step)  # type: ignore[arg-type]
    assert all(isinstance(o, SparseGrad) for per in outcomes for o in per)
    return list(net.ops)


def schedules(seed: int, scheme: str, count: int, **step: object) -> list[Schedule]:
    ops = clean_ops(scheme, **step)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind, node = rng.choice(["kill", "kill", "kill", "pause", "leave", "leave_early"]), rng.randrange(NODES)
        # half of them in the commit (its last 4 (n - 1) sends and receives), where a stop is subtlest
        commit = 4 * (NODES - 1)
        op = ops[node] - 1 - rng.randrange(commit) if rng.random() < 0.5 else rng.randrange(ops[node])
        out.append(Schedule(kind, node, op, pause_s=rng.choice([0.05, 0.3])))
    return out


@pytest.mark.slow  # 60 schedules a scheme, 5 s each: `make test` runs it, `make test-fast` does not
@pytest.mark.parametrize("scheme", ["zen", "dense", "sparse_ps"])
def test_under_random_faults_the_nodes_still_up_all_deliver_the_same_bits_or_all_fail(scheme: str) -> None:
    full = reference_sum([grad_of(i, 0, rows=300) for i in range(NODES * TRAINERS)])
    seen = set()
    for fault in schedules(7, scheme, 60):
        net, cluster, nodes, outcomes = run_step(fault, scheme)
        up = [r for r in range(NODES) if r not in net.dead]
        got = [o for r in up for o in outcomes[r] if o != "left"]
        if all(isinstance(o, SparseGrad) for o in got):
            first = got[0]
            assert isinstance(first, SparseGrad)
            for o in got[1:]:
                assert isinstance(o, SparseGrad)
                assert torch.equal(o.indices, first.indices) and torch.equal(o.values, first.values), fault
            assert_close_to(first.to_dense(), full, torch.float32, NODES * TRAINERS)
            seen.add("delivered")
            assert fault.kind in ("none", "pause", "kill"), f"{fault}: delivered without a trainer"
        else:
            errors = [o for o in got if isinstance(o, StepError)]
            assert len(errors) == len(got), f"{fault}: some delivered, some failed: {outcomes}"
            assert {e.code for e in errors} == {codes.ABORTED}, f"{fault}: {[e.message for e in errors]}"
            assert fault.kind in ("kill", "leave", "leave_early"), f"{fault}: failed unfaulted: {errors[0].message}"
            seen.add("aborted")
        # nothing left behind on the nodes still up
        assert cluster.mailbox_messages(except_to=frozenset(net.dead)) == 0, fault
        for r in up:
            assert nodes[r].trainer_steps.in_flight() == 0, fault
        if fault.kind == "pause":
            assert "delivered" in seen  # a straggler is waited for
    assert seen == {"delivered", "aborted"}  # the schedules hit both outcomes


def iteration_of(trainer: int) -> list[torch.Tensor]:
    """A trainer's sparse gradients of one iteration: three tables of different row widths."""
    g = torch.Generator().manual_seed(500 + trainer)
    tables = []
    for rows, shape in ((300, (64,)), (200, (4, 4)), (100, (32,))):
        idx = torch.randint(0, rows, (int(torch.randint(0, rows // 2, (1,), generator=g)),), generator=g)
        tables.append(torch.sparse_coo_tensor(idx.unsqueeze(0), torch.randn(idx.numel(), *shape, generator=g),
                                              (rows, *shape), check_invariants=True))
    return tables


def test_under_random_faults_an_iteration_fused_into_one_step_reaches_every_trainer_whole_or_fails_whole() -> None:
    """The commit's guarantee lifted to the iteration: a backward pass's tables, fused as the backend
    and the hook fuse them (zen.fusion.batches, zen.fused_rows: three row widths, one step), reach
    every trainer of the nodes still up with every table's sum, or fail on all of them; never some
    tables of an iteration delivered and others not."""
    names = ["emb", "pos", "head"]
    tables = iteration_of(0)
    plan = batches([table_of(t) for t in tables], 2**31)
    assert [b.members for b in plan] == [(0, 1, 2)], plan  # one step for the iteration
    packed = [pack(iteration_of(i), names, plan[0]) for i in range(NODES * TRAINERS)]
    spec = TensorSpec(JOB, packed[0].name, (packed[0].num_rows, plan[0].width), "float32", "sparse_rows", False)

    def part(i: int) -> SparseGrad:
        return SparseGrad(packed[i].indices, packed[i].values, packed[i].num_rows)

    full = [sum(iteration_of(i)[k].to_dense() for i in range(NODES * TRAINERS)) for k in range(len(names))]
    seen = set()
    for fault in schedules(11, "zen", 40, spec=spec, part=part):
        net, cluster, nodes, outcomes = run_step(fault, "zen", spec=spec, part=part)
        up = [r for r in range(NODES) if r not in net.dead]
        got = [o for r in up for o in outcomes[r] if o != "left"]
        if all(isinstance(o, SparseGrad) for o in got):
            per_trainer = [unpack(packed[0], o.indices, o.values, [tuple(t.shape[1:]) for t in tables])
                           for o in got if isinstance(o, SparseGrad)]
            for k, want in enumerate(full):
                rows, values = per_trainer[0][k]
                dense = torch.zeros_like(want)
                dense[rows] = values
                assert_close_to(dense, want, torch.float32, NODES * TRAINERS)  # every table, whole
                for other in per_trainer[1:]:
                    assert torch.equal(other[k][0], rows) and torch.equal(other[k][1], values), (fault, names[k])
            seen.add("delivered")
        else:
            errors = [o for o in got if isinstance(o, StepError)]
            assert len(errors) == len(got), f"{fault}: some trainers got the iteration, some failed: {outcomes}"
            seen.add("aborted")
        assert cluster.mailbox_messages(except_to=frozenset(net.dead)) == 0, fault
        assert all(nodes[r].trainer_steps.in_flight() == 0 for r in up), fault
    assert seen == {"delivered", "aborted"}


def test_an_aborted_step_can_be_submitted_again_and_then_sums_every_part() -> None:
    """A trainer left before step 3 started: every node aborted it; with the trainer back (a new
    session), step 3 is submitted again (attempt 1, its own tags) and every trainer gets the sum."""
    cluster = InProcessCluster(2)
    spec = TensorSpec(JOB, "emb", (80, 3), "float32", "sparse_rows", False)
    nodes = [Node(cluster.communicator(r), "zen", timeout_s=10.0) for r in range(2)]
    sessions = [[n.trainer(t, 2) for t in range(2)] for n in nodes]
    grads = {(r, t): grad_of(2 * r + t, 3, rows=80, dim=3) for r in range(2) for t in range(2)}
    results: dict[tuple[int, int], object] = {}

    def submit(r: int, t: int) -> None:
        try:
            results[(r, t)] = nodes[r].submit(sessions[r][t], spec, grads[(r, t)], 3)
        except StepError as exc:
            results[(r, t)] = exc

    first = [threading.Thread(target=submit, args=rt) for rt in [(0, 0), (1, 0), (1, 1)]]
    for th in first:
        th.start()
    poll_for(lambda: nodes[0].trainer_steps.in_flight() and nodes[1].trainer_steps.in_flight(), 30,
             "step 3 open on both nodes (node 0 waiting for its local rank 1)")
    gone = sessions[0][1]
    nodes[0].registry.close_session(gone.session_id)
    nodes[0].trainer_steps.session_closed(gone)
    for th in first:
        th.join(30)
    for rt in [(0, 0), (1, 0), (1, 1)]:
        err = results[rt]
        assert isinstance(err, StepError) and err.code == codes.ABORTED, (rt, err)
        assert "local rank 1" in err.message and "node 0" in err.message and "step 3" in err.message
    assert cluster.mailbox_messages() == 0
    sessions[0][1] = nodes[0].trainer(1, 2)  # the trainer, restarted
    again = [threading.Thread(target=submit, args=(r, t)) for r in range(2) for t in range(2)]
    for th in again:
        th.start()
    for th in again:
        th.join(30)
    full = reference_sum(list(grads.values()))
    for rt in grads:
        got = results[rt]
        assert isinstance(got, SparseGrad), (rt, got)
        assert_close_to(got.to_dense(), full, torch.float32, 4)


def test_an_aborted_step_leaves_every_node_in_the_same_scheme_state() -> None:
    """auto profiles with zen on its first sync, then plans timed trials. Node 1's link drops at its
    first pull, after it sent its own: node 0 completes the exchange (and would plan its trials),
    node 1 does not. Both restore their scheme's state, so the retry and every later step run the
    same scheme on both nodes and sum correctly (they would wait on each other's different
    messages otherwise)."""
    cluster = InProcessCluster(2)
    spec = TensorSpec(JOB, "emb", (400, 4), "float32", "sparse_rows", False)
    plan = FaultPlan(2)
    # node 0 completes its exchange (it is in the commit) before node 1's link drops at its first pull
    in_commit = plan.mark(0, op="send", tag="/have/")
    plan.fail(1, op="recv", tag="/pull/", until=in_commit.fired, message="rank {rank}: rank {peer} dropped the link")
    nodes = [Node(plan.wrap(cluster.communicator(r)), "auto", timeout_s=10.0) for r in range(2)]
    sessions = [n.trainer(0, 1) for n in nodes]

    def step(s: int) -> list[object]:
        out: list[object] = [None, None]

        def one(r: int) -> None:
            try:
                out[r] = nodes[r].submit(sessions[r], spec, grad_of(r, s, rows=400), s)
            except StepError as exc:
                out[r] = exc
        threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        return out

    first = step(0)
    assert all(isinstance(o, StepError) and o.code == codes.ABORTED for o in first), first
    assert in_commit.fired.is_set() and plan.faults[1].fired.is_set()
    for s in [0, 1, 2, 3, 4, 5]:  # the retry, then auto's trials and its choice
        got = step(s)
        assert all(isinstance(o, SparseGrad) for o in got), (s, got)
        a, b = got
        assert isinstance(a, SparseGrad) and isinstance(b, SparseGrad)
        assert torch.equal(a.to_dense(), b.to_dense())
        assert_close_to(a.to_dense(), reference_sum([grad_of(r, s, rows=400) for r in range(2)]), torch.float32, 2)


def test_a_job_run_again_after_all_its_trainers_left_is_not_refused_for_a_vacancy() -> None:
    """A trainer that leaves mid-job leaves a vacancy (new steps fail at once until it is back); a job
    whose trainers all left has ended, and a new run of it waits for its trainers as usual."""
    cluster = InProcessCluster(1)
    spec = TensorSpec(JOB, "emb", (50, 2), "float32", "sparse_rows", False)
    node = Node(cluster.communicator(0), "zen", timeout_s=10.0)
    for session in [node.trainer(0, 2), node.trainer(1, 2)]:  # the first run ends
        node.registry.close_session(session.session_id)
        node.trainer_steps.session_closed(session)
    first = node.trainer(0, 2)  # the second run: local rank 1 comes a little later
    out: list[object] = []

    def submit() -> None:
        try:
            out.append(node.submit(first, spec, grad_of(0, 0, rows=50, dim=2), 0))
        except StepError as exc:
            out.append(exc)

    th = threading.Thread(target=submit)
    th.start()
    poll_for(lambda: node.trainer_steps.in_flight(), 10, "step 0 open, waiting for local rank 1")
    late = node.trainer(1, 2)
    got = node.submit(late, spec, grad_of(1, 0, rows=50, dim=2), 0)
    th.join(10)
    assert isinstance(out[0], SparseGrad) and torch.equal(out[0].to_dense(), got.to_dense()), out


def test_a_vacancy_is_named_until_a_trainer_takes_the_place_and_ready_waits_on_it() -> None:
    """A redo before the place is taken would only be aborted again (a storm of aborts, and a trainer on
    a few redos gives up): Ready waits on the vacancy (trainer_service), which TrainerSteps names."""
    cluster = InProcessCluster(1)
    node = Node(cluster.communicator(0), "zen", timeout_s=10.0)
    stays, leaves = node.trainer(0, 2), node.trainer(1, 2)
    assert node.trainer_steps.vacancy(JOB) is None
    node.registry.close_session(leaves.session_id)
    node.trainer_steps.session_closed(leaves)
    why = node.trainer_steps.vacancy(JOB)
    assert why is not None and "local rank 1 (pid 1001)" in why and "take its place" in why, why
    assert node.trainer_steps.vacancy("another-job") is None
    node.trainer(1, 2)  # the restarted trainer
    assert node.trainer_steps.vacancy(JOB) is None
    assert stays.local_rank == 0


def test_a_step_aborted_by_another_node_keeps_none_of_its_trainers_memory_once_answered() -> None:
    """The error of a failed step is kept as words: its frames (and its cause's) hold the parts, views into
    the trainers' buffers, in reference cycles that only the garbage collector breaks. A daemon whose
    trainers all left held their buffers' memfds until it ran (the fault drill's leak)."""
    cluster = InProcessCluster(2)
    spec = TensorSpec(JOB, "emb", (50, 2), "float32", "sparse_rows", False)
    nodes = [Node(cluster.communicator(r), "zen", timeout_s=10.0) for r in range(2)]
    waiting, leaving = nodes[0].trainer(0, 2), nodes[0].trainer(1, 2)
    remote = nodes[1].trainer(0, 1)
    out: dict[str, object] = {}

    def submit(name: str, node: Node, session: object) -> None:
        try:
            out[name] = node.submit(session, spec, grad_of(0, 0, rows=50, dim=2), 0)  # type: ignore[arg-type]
        except StepError as exc:
            out[name] = exc.code
    gc.disable()  # what a quiet daemon sees: no collection between the step and the check
    try:
        threads = [threading.Thread(target=submit, args=("waiting", nodes[0], waiting)),
                   threading.Thread(target=submit, args=("remote", nodes[1], remote))]
        for th in threads:
            th.start()
        poll_for(lambda: nodes[0].trainer_steps.in_flight() and nodes[1].trainer_steps.in_flight(), 10,
                 "step 0 open on both nodes")
        nodes[0].registry.close_session(leaving.session_id)
        nodes[0].trainer_steps.session_closed(leaving)  # node 0 aborts the step everywhere
        for th in threads:
            th.join(20)
        assert out == {"waiting": codes.ABORTED, "remote": codes.ABORTED}, out
        held = [weakref.ref(b.raw) for b in nodes[1].buffers.values()]
        nodes[1].buffers.clear()  # the session's buffers closed
        assert [r() for r in held] == [None] * len(held)
    finally:
        gc.enable()


def _partitioned_step(plan: FaultPlan, heal_when: Callable[[dict[int, object]], bool]) -> tuple[
        InProcessCluster, dict[int, object], dict[int, object]]:
    """Step 0 on 3 nodes x 1 trainer under `plan`, healed once heal_when(outcomes so far) holds; then step 0
    again (the redo, if it failed) on every node. Returns the outcomes of the first try and of the redo."""
    cluster = InProcessCluster(3)
    spec = TensorSpec(JOB, "emb", (60, 3), "float32", "sparse_rows", False)
    nodes = [Node(plan.wrap(cluster.communicator(r)), "zen", timeout_s=10.0) for r in range(3)]
    sessions = [n.trainer(0, 1) for n in nodes]
    first: dict[int, object] = {}
    redo: dict[int, object] = {}

    def submit(r: int, out: dict[int, object]) -> None:
        try:
            out[r] = nodes[r].submit(sessions[r], spec, grad_of(r, 0, rows=60, dim=3), 0)
        except StepError as exc:
            out[r] = exc
    threads = [threading.Thread(target=submit, args=(r, first)) for r in range(3)]
    for th in threads:
        th.start()
    poll_for(lambda: heal_when(dict(first)), 20, "the moment to heal the partition")
    plan.heal()
    for th in threads:
        th.join(30)
    assert len(first) == 3, first
    if any(isinstance(o, StepError) for o in first.values()):
        threads = [threading.Thread(target=submit, args=(r, redo)) for r in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
    return cluster, first, redo


def test_a_node_cut_off_in_the_commit_aborts_and_the_others_hold_the_result_until_they_hear_it() -> None:
    """The drill's deadlock: node 2 is cut off after its round-1 word left and before the others' came. It
    lacks them and aborts, but its abort reaches nobody; nodes 0 and 1 have every round-1 word and lose
    node 2 in round 2. Before, they delivered (a lost node was taken for a crashed one) while node 2
    aborted: a split, and then each side waited for the other at a different step, for ever. Now they hold
    the result until the link is back and node 2's abort is told on it: every node aborts, the redo sums."""
    plan = FaultPlan(3)
    plan.drop(0, tag="/have/", nth=1)  # rank 0's round-1 word to rank 2 (it sends to 1, then to 2)
    plan.drop(1, tag="/have/", nth=1)  # rank 1's to rank 2 (to 0, then to 2)
    plan.cut(2, op="recv", tag="/have/")  # then rank 2 is cut off as it waits for them
    cluster, first, redo = _partitioned_step(plan, lambda out: 2 in out)
    for r in range(3):
        err = first[r]
        assert isinstance(err, StepError) and err.code == codes.ABORTED, (r, err)
    full = reference_sum([grad_of(r, 0, rows=60, dim=3) for r in range(3)])
    for r in range(3):
        got = redo[r]
        assert isinstance(got, SparseGrad), (r, got)
        assert_close_to(got.to_dense(), full, torch.float32, 3)
    assert cluster.mailbox_messages() == 0


def test_nodes_that_lose_each_other_after_every_round_1_word_hold_then_all_deliver() -> None:
    """Node 2 is cut off once every round-1 word is in, and the round-2 words across the cut are lost:
    every node holds (none knows whether the other side aborted) while the cut lasts, and all deliver
    once it heals and nobody replays an abort."""
    plan = FaultPlan(3)
    for r, nth in [(2, 0), (2, 1), (0, 1), (1, 1)]:  # every round-2 word across the cut
        plan.drop(r, tag="/all/", nth=nth)
    plan.cut(2, op="recv", tag="/all/")
    started = time.monotonic()
    cluster, first, redo = _partitioned_step(plan, lambda out: time.monotonic() - started > 1.0)
    full = reference_sum([grad_of(r, 0, rows=60, dim=3) for r in range(3)])
    for r in range(3):
        got = first[r]
        assert isinstance(got, SparseGrad), (r, got)
        assert_close_to(got.to_dense(), full, torch.float32, 3)
    assert not redo and cluster.mailbox_messages() == 0


def test_nodes_holding_on_each_other_deliver_as_soon_as_the_cut_heals_not_after_a_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A freeze or a cut in round 2 leaves both sides holding, each waiting for the other's round-2 word
    that went down with the old link. Each says its word again on the new link, so both deliver at the
    heal; before, each waited REPLAY_GRACE_S (2 s: a frozen node's peers were back 1.9-2.3 s after the
    thaw). The grace is made longer than the step timeout here: only the words said again end it."""
    monkeypatch.setattr(node_steps, "REPLAY_GRACE_S", 60.0)
    plan = FaultPlan(3)
    for r, nth in [(2, 0), (2, 1), (0, 1), (1, 1)]:
        plan.drop(r, tag="/all/", nth=nth)
    plan.cut(2, op="recv", tag="/all/")
    started, healed = time.monotonic(), []

    def heal_when(out: dict[int, object]) -> bool:
        if time.monotonic() - started > 1.0:
            healed.append(time.monotonic())
            return True
        return False
    cluster, first, redo = _partitioned_step(plan, heal_when)
    took = time.monotonic() - healed[0]
    full = reference_sum([grad_of(r, 0, rows=60, dim=3) for r in range(3)])
    for r in range(3):
        got = first[r]
        assert isinstance(got, SparseGrad), (r, got)
        assert_close_to(got.to_dense(), full, torch.float32, 3)
    assert not redo and cluster.mailbox_messages() == 0
    assert took < 4.0, f"the holds ended {took:.1f} s after the heal: they waited out the step timeout"


def test_a_node_a_step_behind_at_a_tensors_first_step_learns_where_the_job_is_and_they_meet() -> None:
    """The drill's other deadlock: every daemon restarted (nothing remembers where the job is), node 0's
    trainers come back at step 5 (they lost its result) and node 1's at step 6. Before, each waited for
    the other's step-5 (step-6) word until the step timeout, and again after every redo. Now node 0 sees
    node 1's step-6 word waiting and fails its step at once, saying the job is at step 6; node 1 waits on,
    and the step runs once node 0's trainers resume there."""
    cluster = InProcessCluster(2)
    spec = TensorSpec(JOB, "emb", (60, 3), "float32", "sparse_rows", False)
    nodes = [Node(cluster.communicator(r), "zen", timeout_s=30.0) for r in range(2)]
    learned: list[StepKey] = []
    nodes[0].trainer_steps.learn_step = learned.append
    sessions = [n.trainer(0, 1) for n in nodes]
    ahead: dict[str, object] = {}

    def node_1_at_step_6() -> None:
        try:
            ahead["out"] = nodes[1].submit(sessions[1], spec, grad_of(1, 6, rows=60, dim=3), 6)
        except StepError as exc:
            ahead["out"] = exc

    waiting = threading.Thread(target=node_1_at_step_6)
    waiting.start()
    t0 = time.monotonic()
    with pytest.raises(StepError, match=r"node 1 is at step 6 of tensor 'emb'.*the job is at step 6") as behind:
        nodes[0].submit(sessions[0], spec, grad_of(0, 5, rows=60, dim=3), 5)
    assert behind.value.code == codes.ABORTED and time.monotonic() - t0 < 5
    assert [(k.job, k.step) for k in learned] == [(JOB, 6)] and waiting.is_alive()  # node 1 waits on
    got = nodes[0].submit(sessions[0], spec, grad_of(0, 6, rows=60, dim=3), 6)  # node 0's trainer resumed
    waiting.join(30)
    full = reference_sum([grad_of(r, 6, rows=60, dim=3) for r in range(2)])
    for out in (got, ahead["out"]):
        assert isinstance(out, SparseGrad), out
        assert_close_to(out.to_dense(), full, torch.float32, 2)
    assert cluster.mailbox_messages() == 0


@pytest.mark.parametrize("first", ["ahead", "behind"])
def test_a_trainer_a_step_behind_its_nodes_others_learns_where_the_job_is(first: str) -> None:
    """After every daemon restarted, a trainer restarted too is told step 0 (nobody remembers) while the
    other trainer of its node waits at step 6. Before, the two steps waited for each other until the step
    timeout (or the later one was refused as out of order). Now whichever comes second, the trainer behind
    gets ABORTED saying the job is at step 6 (learned by the node: Ready's job_step), a trainer that opens
    a session meanwhile is told step 6, and once it resumes there the step runs with both parts."""
    cluster = InProcessCluster(2)
    spec = TensorSpec(JOB, "emb", (60, 3), "float32", "sparse_rows", False)
    nodes = [Node(cluster.communicator(r), "zen", timeout_s=30.0) for r in range(2)]
    learned: list[StepKey] = []
    nodes[0].trainer_steps.learn_step = learned.append
    sessions = [[n.trainer(t, 2) for t in range(2)] for n in nodes]
    outs: dict[tuple[int, int], object] = {}

    def submit(r: int, t: int, step: int) -> None:
        try:
            outs[(r, t)] = nodes[r].submit(sessions[r][t], spec, grad_of(2 * r + t, step, rows=60, dim=3), step)
        except StepError as exc:
            outs[(r, t)] = exc

    others = [threading.Thread(target=submit, args=(1, t, 6)) for t in range(2)]  # node 1: both at step 6
    for th in others:
        th.start()
    ahead = threading.Thread(target=submit, args=(0, 1, 6))
    behind = threading.Thread(target=submit, args=(0, 0, 0))
    for th in ([ahead, behind] if first == "ahead" else [behind, ahead]):
        th.start()
        poll_for(lambda: nodes[0].trainer_steps.in_flight() or (0, 0) in outs, 10, "the step to open")
    behind.join(10)
    err = outs[(0, 0)]
    assert isinstance(err, StepError) and err.code == codes.ABORTED and "the job is at step 6" in err.message, err
    assert {(k.job, k.step) for k in learned} == {(JOB, 6)}
    assert list(nodes[0].trainer_steps.open_steps_of(JOB).values()) == [6]
    submit(0, 0, 6)  # the trainer behind resumes where the job is
    for th in [ahead, *others]:
        th.join(30)
    full = reference_sum([grad_of(i, 6, rows=60, dim=3) for i in range(4)])
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        assert isinstance(outs[key], SparseGrad), (key, outs[key])
        assert_close_to(outs[key].to_dense(), full, torch.float32, 4)  # type: ignore[union-attr]
    assert cluster.mailbox_messages() == 0
