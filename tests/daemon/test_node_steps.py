"""The node's step in-process: n nodes of k trainers, each node wired as the daemon wires it
(JobRegistry, TrainerSteps, NodeSteps, DaemonMetrics) but over an InProcessCluster, with a dict
for its trainers' buffers: no gRPC, no sockets, no processes."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.core.helpers import assert_close_to, reference_sum
from zend.core import SCHEMES, SparseGrad, make_scheme
from zend.core.comm import Communicator
from zend.daemon import errors as codes
from zend.daemon import node_state
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry, Session
from zend.daemon.metrics import DaemonMetrics
from zend.daemon.node_state import NodeStateHolder
from zend.daemon.node_steps import NodeSteps
from zend.daemon.trainer_steps import TrainerSteps
from zend.protocol.layout import TensorSpec
from zend.protocol.step import BufferRef, StepRequest
from zend.transport.inproc import InProcessCluster

pytestmark = pytest.mark.inprocess

SECRET = b"in-process-node-step-secret"
JOB = "job"


class MemoryBuffer:
    """A trainer's buffer in plain memory, with the view a SharedBuffer gives the daemon."""

    def __init__(self, buffer_id: str, nbytes: int):
        self.buffer_id, self.nbytes = buffer_id, nbytes
        self.raw = torch.zeros(nbytes, dtype=torch.uint8)

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
        return self.raw[offset: offset + count * dtype.itemsize].view(dtype)

    def publish(self) -> None:  # plain memory: both sides see every write at once
        pass

    def acquire(self) -> None:
        pass


class Node:
    """One node's daemon parts over `comm`; `submit` is what a trainer's Submit does, minus gRPC."""

    def __init__(self, comm: Communicator, scheme: str, timeout_s: float = 30.0):
        self.registry = JobRegistry(SECRET)
        self.buffers: dict[tuple[str, str], MemoryBuffer] = {}
        self.metrics = DaemonMetrics(comm.rank)
        self.trainer_steps = TrainerSteps(self.registry, lambda s, b: self.buffers[(s, b)], self.metrics, timeout_s)
        self.trainer_steps.open(NodeSteps(self.metrics.counting(comm), timeout_s))
        self.scheme = scheme

    def trainer(self, local_rank: int, local_world_size: int) -> Session:
        return self.registry.open_session(JOB, local_rank, local_world_size, pid=1000 + local_rank)

    def submit(self, session: Session, spec: TensorSpec, grad: SparseGrad, step: int) -> SparseGrad:
        state = self.registry.register(session, spec, lambda: make_scheme(self.scheme, seed=3))
        sid = session.session_id
        source = self.buffers[(sid, f"in{step}")] = MemoryBuffer(f"in{step}", max(64, spec.nbytes(grad.nnz)))
        result = self.buffers[(sid, "out")] = MemoryBuffer("out", spec.max_bytes)
        spec.write(grad, source.view, 0)
        outcome = self.trainer_steps.step(session, StepRequest(state.tensor_id, step, BufferRef(source.buffer_id),
                                                               grad.nnz, BufferRef("out"), timeout_s=30.0))
        return spec.read(result.view, 0, outcome.nnz, check=False)


def run_job(nodes: int, trainers: int, scheme: str, body: Callable[[Node, Session, int], Any]) -> list[list[Any]]:
    """body(node, session, trainer index) on every trainer of every node at once; results[node][local rank],
    an exception where the body raised one."""
    def node_main(rank: int, comm: Communicator) -> list[Any]:
        node = Node(comm, scheme)
        sessions = [node.trainer(r, trainers) for r in range(trainers)]
        out: list[Any] = [None] * trainers

        def run(r: int) -> None:
            try:
                out[r] = body(node, sessions[r], rank * trainers + r)
            except Exception as exc:
                out[r] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(trainers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a trainer is still waiting"
        return out

    return InProcessCluster(nodes).run(node_main, timeout_s=120)


def grad_of(trainer: int, step: int, rows: int = 120, dim: int = 4, dtype: torch.dtype = torch.float32) -> SparseGrad:
    g = torch.Generator().manual_seed(1000 * step + trainer)
    nnz = int(torch.randint(0, rows // 2, (1,), generator=g))
    idx = torch.randint(0, rows, (nnz,), generator=g)  # duplicates on purpose: the node coalesces
    return SparseGrad(idx, torch.randn(nnz, dim, generator=g).to(dtype), rows)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("nodes", [1, 2, 3, 4])
@pytest.mark.parametrize("trainers", [1, 2, 3])
def test_every_trainer_of_every_node_gets_the_sum_of_all_parts(scheme: str, nodes: int, trainers: int) -> None:
    spec = TensorSpec(JOB, "emb", (120, 4), "float32", "sparse_rows", False)
    steps = 2  # the second step runs without the agreement, and auto on its choice

    def body(node: Node, session: Session, trainer: int) -> list[SparseGrad]:
        return [node.submit(session, spec, grad_of(trainer, step), step) for step in range(steps)]

    results = run_job(nodes, trainers, scheme, body)
    everyone = [got for per_node in results for got in per_node]
    for got in everyone:
        assert not isinstance(got, BaseException), got
    for step in range(steps):
        expected = reference_sum([grad_of(t, step) for t in range(nodes * trainers)])
        first = everyone[0][step]
        assert_close_to(first.to_dense(), expected, torch.float32, nodes * trainers)
        for got in everyone[1:]:  # the same bits on every trainer of every node
            assert torch.equal(got[step].indices, first.indices) and torch.equal(got[step].values, first.values)


@pytest.mark.parametrize("scheme", ["zen", "dense", "auto"])
def test_dense_layout_half_precision_and_average(scheme: str) -> None:
    spec = TensorSpec(JOB, "w", (40, 3), "float16", "dense", True)
    nodes, trainers = 3, 2

    def dense_of(trainer: int) -> SparseGrad:
        values = torch.randn(40, 3, generator=torch.Generator().manual_seed(trainer)).to(torch.float16)
        return SparseGrad(torch.arange(40), values, 40, "w", True)

    results = run_job(nodes, trainers, scheme, lambda node, s, t: node.submit(s, spec, dense_of(t), 0))
    expected = reference_sum([dense_of(t) for t in range(nodes * trainers)], average=True)
    for per_node in results:
        for got in per_node:
            assert not isinstance(got, BaseException), got
            assert_close_to(got.to_dense(), expected, torch.float16, nodes * trainers)


def test_a_node_that_describes_the_tensor_differently_fails_the_step_on_every_node() -> None:
    def body(node: Node, session: Session, trainer: int) -> SparseGrad:
        dim = 16 if trainer // 2 == 2 else 8  # node 2 (trainers 4 and 5) registers a wider tensor
        spec = TensorSpec(JOB, "emb", (100, dim), "float32", "sparse_rows", False)
        return node.submit(session, spec, grad_of(trainer, 0, rows=100, dim=dim), 0)

    results = run_job(3, 2, "zen", body)
    for per_node in results:
        for got in per_node:
            assert isinstance(got, StepError) and got.code == codes.INVALID_ARGUMENT, got
            assert "tensor 'emb' of job 'job': node 2 has shape=[100, 16] but node 0 has shape=[100, 8]" in got.message


def test_steps_are_recorded_by_the_metrics_owner_and_levels_read_at_scrape_time() -> None:
    spec = TensorSpec(JOB, "emb", (120, 4), "float32", "sparse_rows", False)
    nodes: list[Node] = []

    def body(node: Node, session: Session, trainer: int) -> SparseGrad:
        if trainer % 2 == 0:
            nodes.append(node)
        return node.submit(session, spec, grad_of(trainer, 0), 0)

    run_job(2, 2, "zen", body)
    for node in nodes:
        sample = node.metrics.registry.get_sample_value
        assert sample("zen_tensor_steps_total", {"scheme": "zen"}) == 1
        assert sample("zen_sync_duration_seconds_count", {"scheme": "zen", "phase": "deliver"}) == 2
        assert sample("zen_tensor_input_rows", {"zen_job": JOB, "tensor": "emb"}) > 0
        assert sample("zen_steps_in_flight") == 0  # nothing watched: the levels read as zero
        node.metrics.watch(lambda node=node: _readings(node))  # type: ignore[misc]
        assert sample("zen_connected_trainers") == 0 and sample("zen_steps_in_flight") == 0
        assert sample("zen_peer_up", {"peer": "1"}) == 1.0
        stats = node.registry.tensor_list()[0].stats
        assert (stats.steps, stats.last_step, stats.scheme) == (1, 0, "zen") and stats.last_nnz_out > 0


def _readings(node: Node) -> Any:
    from zend.daemon.metrics import NodeReadings

    return NodeReadings(connected_trainers=node.registry.connected_trainers(),
                        steps_in_flight=node.trainer_steps.in_flight(), peer_up={1: True})


def test_a_trainer_that_leaves_fails_its_partners_step_at_once() -> None:
    spec = TensorSpec(JOB, "emb", (50, 2), "float32", "sparse_rows", False)
    cluster = InProcessCluster(1)
    node = Node(cluster.communicator(0), "zen")
    stay, leave = node.trainer(0, 2), node.trainer(1, 2)
    outcome: list[BaseException] = []

    def partner() -> None:
        try:
            node.submit(stay, spec, grad_of(0, 0, rows=50, dim=2), 0)
        except StepError as exc:
            outcome.append(exc)

    t = threading.Thread(target=partner)
    t.start()
    while node.trainer_steps.in_flight() == 0:
        t.join(0.01)
    node.registry.close_session(leave.session_id)
    node.trainer_steps.session_closed(leave)
    t.join(10)
    (err,) = outcome
    assert isinstance(err, StepError) and err.code == codes.ABORTED and "local rank 1" in err.message


def test_steps_are_refused_until_the_node_has_joined_and_after_it_drains() -> None:
    metrics = DaemonMetrics(0)
    registry = JobRegistry(SECRET)
    node = NodeStateHolder()
    steps = TrainerSteps(registry, lambda s, b: MemoryBuffer(b, 4096), metrics, 5.0, state=lambda: node.state)
    with pytest.raises(StepError, match="still joining its cluster") as err:
        steps.check_accepting("sessions")
    assert err.value.code == codes.UNAVAILABLE
    node.apply(node_state.joined)
    with pytest.raises(StepError, match="between generations") as err:  # joined, no step runner yet
        steps.check_accepting("steps")
    steps.open(NodeSteps(InProcessCluster(1).communicator(0), 5.0))
    steps.check_accepting("sessions")
    steps.check_accepting("steps")
    node.apply(node_state.changing("node 2 left"))
    with pytest.raises(StepError, match="membership changes") as err:
        steps.check_accepting("steps")
    assert err.value.code == codes.ABORTED
    steps.check_accepting("sessions")  # sessions stay open across a change
    node.apply(node_state.changed)
    node.apply(node_state.drain())
    assert steps.wait_in_flight(1.0) == (0, 0)
    with pytest.raises(StepError, match="draining: no new steps") as err:
        steps.check_accepting("steps")
    assert err.value.code == codes.UNAVAILABLE


class RowOutOfRange:
    """A scheme whose result holds a row past the tensor's end, as a hostile peer's pull would make it."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sync(self, channel: Any, grad: SparseGrad, average: bool = False, place: Any = None) -> Any:
        result = self.inner.sync(channel, grad, average=average)
        g = result.grad
        bad = SparseGrad(torch.cat([g.indices, torch.tensor([g.num_rows + 5])]), torch.cat([g.values, g.values[:1]]),
                         g.num_rows, g.name, True)
        return dataclasses.replace(result, grad=bad)


def test_a_row_outside_the_tensor_in_a_nodes_sum_fails_the_step_on_every_node_before_delivery() -> None:
    spec = TensorSpec(JOB, "emb", (120, 4), "float32", "sparse_rows", False)

    def body(node: Node, session: Session, trainer: int) -> SparseGrad:
        if trainer == 1:  # node 1's sum comes out with row 125 of a 120-row tensor
            node.registry.register(session, spec, lambda: RowOutOfRange(make_scheme("zen", seed=3)))
        return node.submit(session, spec, grad_of(trainer, 0), 0)

    results = [got for per_node in run_job(3, 1, "zen", body) for got in per_node]
    for got in results:
        assert isinstance(got, StepError) and got.code == codes.INVALID_ARGUMENT, got
        assert "row 125, outside [0, 120)" in got.message, got.message


def _submit_into(node: Node, session: Session, spec: TensorSpec, grad: SparseGrad, step: int,
                 result: MemoryBuffer) -> Any:
    """A trainer's Submit whose result buffer is `result` (kept across steps, as a trainer's is)."""
    state = node.registry.register(session, spec, lambda: make_scheme(node.scheme, seed=3))
    sid = session.session_id
    source = node.buffers[(sid, f"in-{spec.name}-{step}")] = MemoryBuffer(f"in-{spec.name}-{step}",
                                                                         max(64, spec.nbytes(grad.nnz)))
    node.buffers[(sid, result.buffer_id)] = result
    spec.write(grad, source.view, 0)
    return node.trainer_steps.step_outcome(session, StepRequest(state.tensor_id, step, BufferRef(source.buffer_id),
                                                                grad.nnz, BufferRef(result.buffer_id, 64), 30.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, average", [(4, False), (4, True), (64, True)])
def test_zen_assembles_the_sum_in_the_trainers_result_buffer(dtype: torch.dtype, dim: int, average: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """One trainer per node: ZEN writes the sum (and the mean) straight into the trainer's result buffer,
    where delivery then has nothing to write; the bits are those of the path that assembles elsewhere
    and copies (dim 4: whole rows merged; dim 64: slices placed through the table)."""
    spec = TensorSpec(JOB, "emb", (120, dim), str(dtype).removeprefix("torch."), "sparse_rows", average)

    def body(node: Node, session: Session, trainer: int) -> list[tuple[bool, SparseGrad]]:
        result = MemoryBuffer("out", 64 + spec.max_bytes)
        out = []
        for step in range(2):
            outcome = _submit_into(node, session, spec, grad_of(trainer, step, dim=dim, dtype=dtype), step, result)
            base = result.raw.data_ptr()
            inside = base <= outcome.grad.values.data_ptr() < base + result.nbytes
            got = spec.read(result.view, 64, outcome.grad.nnz, check=False)
            out.append((inside and outcome.placed is not None, SparseGrad(got.indices, got.values.clone(), 120)))
        return out

    placed = run_job(2, 1, "zen", body)
    monkeypatch.setattr(TrainerSteps, "_room", lambda self, ticket: None)
    copied = run_job(2, 1, "zen", body)
    for per_node_placed, per_node_copied in zip(placed, copied, strict=True):
        (steps_placed,), (steps_copied,) = per_node_placed, per_node_copied
        for (in_place, a), (elsewhere, b) in zip(steps_placed, steps_copied, strict=True):
            assert in_place and not elsewhere
            assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    expected = reference_sum([grad_of(t, 1, dim=dim, dtype=dtype) for t in range(2)])
    assert_close_to(placed[0][0][1][1].to_dense() * (2 if average else 1), expected, dtype, 2)


def test_a_kept_result_whose_buffer_took_a_later_result_is_not_served() -> None:
    """A repeat of a finished step is answered from the kept result; if that result lay in a buffer
    that has since received another tensor's sum, the repeat fails instead of reading the newer one."""
    emb = TensorSpec(JOB, "emb", (120, 4), "float32", "sparse_rows", False)
    other = TensorSpec(JOB, "other", (120, 4), "float32", "sparse_rows", False)

    def body(node: Node, session: Session, trainer: int) -> Any:
        shared = MemoryBuffer("out", 64 + emb.max_bytes)
        first = _submit_into(node, session, emb, grad_of(trainer, 0), 0, shared)
        again = _submit_into(node, session, emb, grad_of(trainer, 0), 0, shared)  # a repeat: the same answer
        assert again is first
        _submit_into(node, session, other, grad_of(trainer, 5), 0, shared)  # its sum lands in the same buffer
        with pytest.raises(StepError) as late:
            _submit_into(node, session, emb, grad_of(trainer, 0), 0, shared)
        return late.value

    for (err,) in run_job(2, 1, "zen", body):
        assert isinstance(err, StepError) and err.code == codes.FAILED_PRECONDITION, err
        assert "holds a later result" in err.message
