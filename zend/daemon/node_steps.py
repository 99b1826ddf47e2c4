"""The node's part of one step: its trainers' parts summed, checked, synchronised and averaged.

Written against a Communicator and plain values (a TensorState, the parts, a StepKey), with no
gRPC and no buffers, so it runs the same over the daemons' data plane and over an
InProcessCluster in the tests. Every failure comes out as one StepError, which the caller
hands to every trainer waiting for the step.

Every node the same outcome: a node delivers a step only after the *commit* (`commit`, two
tiny all-to-all rounds after the scheme: 2 x (n - 1) one-byte messages each way per node). A
node whose step fails anywhere aborts it on every node (`Communicator.abort`, the reason and
status travelling with it), so every trainer of the step, on every node, gets the same error
and nobody delivers. A node that itself stood still long enough for its peers to declare it
lost (SIGSTOP, swap) before its vote left aborts rather than vote: its peers gave up on it.
What remains: a link cut between two live nodes during the commit (a partition) can split
them, and a pause falling in the few instructions between a vote's send and the check after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zend.core import costmodel
from zend.core.codec import PeerMessageError
from zend.core.comm import Channel, CommAborted, CommError, CommTimeout, Communicator
from zend.core.schemes import SyncResult
from zend.core.sparse import ResultPlace, SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.agreement import agree
from zend.daemon.errors import StepError
from zend.daemon.jobs import TensorState, job_key
from zend.daemon.steps import StepKey
from zend.protocol.layout import TensorSpec

log = logging.getLogger("zend.node")
# a peer back after a loss replays its recent aborts first thing on the new link: this long is plenty
REPLAY_GRACE_S = 2.0
# waiting for a peer's first word on a tensor in a generation: how often to look whether it is a step ahead
AHEAD_POLL_S = 0.25


@dataclass
class StepOutcome:
    """A step's result on this node, with what the metrics and `zend status` report of it."""

    grad: SparseGrad  # the sum (or mean) over every trainer of the job, coalesced
    scheme: str  # the scheme that ran ("auto:zen" when auto chose zen)
    bytes_sent: int
    bytes_received: int
    dense_bytes: int  # what a dense ring allreduce would have sent from this node
    nnz_in: int  # rows of this node's local sum
    mean_input_rows: float | None  # cluster-wide mean of rows per node, when the scheme knows it
    push_load_imbalance: float
    pull_imbalance: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds: wait, local_sum, agree, exchange, commit
    generation: int = 0  # the membership generation the step ran in
    nodes: int = 1  # and its number of nodes
    placed: object = None  # the `place` whose room `grad` lies in (assembled there), else None

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


def local_sum(spec: TensorSpec, grads: Sequence[SparseGrad]) -> SparseGrad:
    """The node's gradient: the sum of its trainers' parts (float32 accumulation, one rounding), on the
    first part's device (one trainer per GPU: each part lies on its trainer's own GPU)."""
    if len(grads) == 1:
        return grads[0].coalesce()
    device = grads[0].device
    if spec.layout == "dense":
        total = grads[0].values.to(torch.float32).clone()
        for g in grads[1:]:
            total += g.values.to(device)
        return SparseGrad(grads[0].indices, total.to(spec.dtype), spec.num_rows, spec.name, True)
    indices = torch.cat([g.indices.to(device, torch.int64) for g in grads])
    values = torch.cat([g.values.to(device) for g in grads])
    return SparseGrad(indices, values, spec.num_rows, spec.name).coalesce()


class NodeSteps:
    """Runs the steps of this node's tensors over the data plane `comm` (one node = one rank)."""

    def __init__(self, comm: Communicator, timeout_s: float, generation: int = 0):
        self.comm = comm
        self.timeout_s = timeout_s
        self.generation = generation

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def run(self, state: TensorState, key: StepKey, parts: Sequence[SparseGrad], waited_s: float = 0.0,
            attempt: int = 0, place: ResultPlace | None = None) -> StepOutcome:
        """The step's outcome from the local parts (in local-rank order); StepError on any failure,
        after which every node aborts the step. The scheme may assemble the result in `place`'s room
        (the outcome's grad is then a view of it)."""
        try:
            return self._run(state, key, parts, waited_s, attempt, place)
        except Exception as exc:
            err = as_step_error(exc, f"step {key.step} of tensor {state.spec.name!r}", self.comm.rank)
            self.comm.abort(sync_prefix(key, attempt), err.message, err.code)
            raise err from None

    def aborted(self, key: StepKey, attempt: int) -> bool:
        """Whether that attempt of the step was aborted already (here, or a peer's notice came first)."""
        return self.comm.voided(sync_prefix(key, attempt))

    def abort(self, key: StepKey, attempt: int, error: StepError) -> None:
        """Abort a step that failed here before it ran (a trainer lost, or late): on every node."""
        self.comm.abort(sync_prefix(key, attempt), error.message, error.code)

    def _run(self, state: TensorState, key: StepKey, parts: Sequence[SparseGrad], waited_s: float,
             attempt: int, place: ResultPlace | None) -> StepOutcome:
        spec = state.spec
        phases: dict[str, float] = {"wait": waited_s}
        started = time.monotonic()
        sync_id = sync_prefix(key, attempt).rstrip("/")  # tags of this attempt of this step only
        with state.lock:  # one step of a tensor at a time, in step order
            saved = state.scheme.checkpoint()
            try:
                t = time.perf_counter()
                grad = local_sum(spec, parts)
                phases["local_sum"] = time.perf_counter() - t
                if not state.agreed:
                    t = time.perf_counter()
                    channel = Channel(self.comm, sync_id, self.timeout_s)
                    agree(channel, spec, state.local_world_size,
                          lambda j: self._await_description(channel, key, spec.name, j))
                    phases["agree"] = time.perf_counter() - t
                t = time.perf_counter()
                given: list[tuple[torch.Tensor, torch.Tensor]] = []
                result = state.scheme.sync(Channel(self.comm, sync_id, self.timeout_s), grad, average=False,
                                           place=_recorded(place, given) if place is not None else None)
                phases["exchange"] = time.perf_counter() - t
                in_place = bool(given) and result.grad.values.data_ptr() == given[-1][1].data_ptr()
                outcome = self._outcome(state, grad, result, phases, in_place)  # all that can fail, before the commit
                outcome.placed = place if in_place else None
                t = time.perf_counter()
                self.commit(Channel(self.comm, sync_id, self.timeout_s), started)
            except BaseException:
                state.scheme.restore(saved)  # every node retries from the same scheme state
                raise
            # committed: from here on nothing may fail
            state.agreed = True
            phases["commit"] = time.perf_counter() - t
        return outcome

    def _await_description(self, channel: Channel, key: StepKey, name: str, j: int) -> torch.Tensor:
        """Node j's description of the tensor (a tensor's first step in a generation), looking while it does
        not come whether j is a step ahead: its message for the next step waits here.

        When every daemon restarted, nothing remembers where the job is but the trainers, and a node whose
        trainers lost the last step's result (a trainer, or its daemon, killed just after the step was
        delivered) comes back a step behind the others: the two would wait on each other, step timeout after
        step timeout. The node behind fails the step, saying where the job is (its trainers learn it from
        wait_ready: OutOfOrder, resume there); the node ahead waits on, and the step runs once they meet."""
        timeout_s = channel.timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        ahead = f"{job_key(key.job)}/{key.tensor_id}/{key.step + 1}/"
        link = self.comm.link_epoch(j)  # each short recv sees only its own span: a link that dropped and came
        while True:  # back between two of them may have taken the description with it
            if self.comm.link_epoch(j) != link:
                raise CommError(f"rank {self.comm.rank}: the link to rank {j} dropped while its description of "
                                f"tensor {name!r} was awaited")
            left = deadline - time.monotonic()
            try:
                return channel.recv(j, "agree", timeout_s=max(0.001, min(AHEAD_POLL_S, left)))
            except CommTimeout:
                if left <= AHEAD_POLL_S:
                    raise CommTimeout(f"rank {self.comm.rank}: no message from rank {j} (tag "
                                      f"{channel.sync_id}/agree/0) within {timeout_s:g} s") from None
            if self.comm.holds(j, ahead):
                raise StepError(codes.ABORTED, f"node {j} is at step {key.step + 1} of tensor {name!r}: step "
                                               f"{key.step} finished on every node while this node's trainers or "
                                               f"daemon restarted, and its result is lost here; the job is at step "
                                               f"{key.step + 1}", job_step=key.step + 1)

    def commit(self, channel: Channel, started: float) -> None:
        """Return once every node holds the result and none aborted; raise (the step aborts) otherwise.

        Round 1: "I have it" to every node, and wait for every node's. Round 2: "I have every
        node's", and wait for every node's; a node that lacked a round-1 word aborts the step
        everywhere instead. A node lost in round 2 had the result (its round-1 word says so), but
        it may be alive behind a partition, having aborted: this node holds the result and does not
        decide alone (`_hold`) until the link is back and the peer's recent aborts are replayed on
        it. So with nodes that stop (crash, kill), the survivors all deliver or all abort, wherever
        the stop falls, and a partition that heals within the step timeout splits nobody."""
        if self.world_size == 1:
            return
        links = {j: self.comm.link_epoch(j) for j in self._others()}  # a link that drops from here on may lose words
        stood_still = self.comm.stalled_since(started)
        if stood_still is None:
            before = time.monotonic()
            self._all_send(channel, "have")
            stood_still = self.comm.stalled_since(before)  # a pause before our word left: peers gave up
        if stood_still is not None:
            raise StepError(codes.ABORTED, f"node {self.comm.rank} stood still for {stood_still:.1f} s during "
                                           "the step: its peers may have declared it lost")
        channel.exchange("have", [], self._others())  # every node's word, in one call
        self._all_send(channel, "all", tolerate_lost=True)
        for j in self._others():  # a lost node's word may still be here: take it, leave nothing behind
            if self.comm.link_epoch(j) != links[j]:  # its word may have gone down with the old link
                self._hold(channel, j, CommError(f"the link to node {j} dropped during the commit"))
                continue
            try:
                channel.recv(j, "all")
            except (CommAborted, CommTimeout):
                raise
            except CommError as exc:  # lost after it said it has the result
                self._hold(channel, j, exc)

    def _hold(self, channel: Channel, j: int, lost: CommError) -> None:
        """Node j was lost in round 2. It may have aborted (it lacked a round-1 word: behind a partition
        its abort reached nobody), or delivered, or be holding as we are. Wait for a new link to it: its
        recent aborts come first on it (CommAborted: every node aborts), else its word (a node holding on us
        says it again on the new link, as we do), else nothing within REPLAY_GRACE_S (it delivered, or
        restarted and knows nothing of the step: it had the result, so we deliver). If no link comes back
        (the step timeout passes, or the generation ends and closes the transport), a crash is the likelier
        story: deliver, as before holding."""
        log.warning("node %d lost during the commit of %s, after its vote: %s; holding the result until it "
                    "is back", j, channel.sync_id, lost)
        deadline = time.monotonic() + (channel.timeout_s or self.timeout_s or 60.0)
        told = None  # the link on which this node's own word went again
        while (left := deadline - time.monotonic()) > 0:
            if not self.comm.wait_relinked(j, left):
                break
            try:
                if told != (epoch := self.comm.link_epoch(j)):
                    # our word may have gone down with the old link, and j may be holding on us as we are on
                    # it (a freeze or a cut in round 2 leaves both sides so): saying it again on the new link
                    # ends j's hold at once instead of after REPLAY_GRACE_S; where j is done, it is discarded
                    channel.send(j, "all", torch.ones(1, dtype=torch.uint8))
                    told = epoch
                channel.recv(j, "all", timeout_s=min(REPLAY_GRACE_S, max(0.01, deadline - time.monotonic())))
                return
            except CommAborted:
                raise
            except CommTimeout:
                log.warning("node %d is back and did not abort %s: delivering", j, channel.sync_id)
                return
            except CommError:  # the old link, not yet marked down, or lost again: wait for the next one
                time.sleep(0.05)
        log.warning("node %d did not come back during the commit of %s: delivering (it had the result)", j,
                    channel.sync_id)

    def _others(self) -> list[int]:
        return [j for j in range(self.world_size) if j != self.comm.rank]

    def _all_send(self, channel: Channel, phase: str, tolerate_lost: bool = False) -> None:
        """One byte to every other node; a lost one is skipped if tolerate_lost, else raises."""
        word = torch.ones(1, dtype=torch.uint8)
        for j in self._others():
            try:
                channel.send(j, phase, word)
            except CommAborted:
                raise
            except CommError:
                if not tolerate_lost:
                    raise

    def _outcome(self, state: TensorState, grad: SparseGrad, result: SyncResult, phases: dict[str, float],
                 in_place: bool) -> StepOutcome:
        spec, out = state.spec, result.grad
        check_rows(spec, out)
        trainers = self.world_size * state.local_world_size
        if spec.average and trainers > 1:  # the scheme summed; the mean is over every trainer of the job
            mean = out.values.to(torch.float32) / trainers  # float32, one rounding: the same bits either way
            if in_place:  # the sum lies in the room we offered (a result buffer): ours to overwrite
                out.values.copy_(mean)
            else:  # it may be a view of a trainer's input (one rank, one trainer)
                out = out.with_values(mean.to(spec.dtype))
        return StepOutcome(out, result.scheme, result.traffic.bytes_sent, result.traffic.bytes_recv,
                           costmodel.dense_ring_bytes(self.world_size, spec.dense_bytes), grad.nnz,
                           result.mean_input_rows, result.push_load_imbalance, result.pull_imbalance, phases,
                           self.generation, self.world_size)


def _recorded(place: ResultPlace, given: list[tuple[torch.Tensor, torch.Tensor]]) -> ResultPlace:
    """`place`, remembering the room it gave (to tell whether the scheme's result is in it)."""
    def offer(rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        room = place(rows)
        if room is not None:
            given.append(room)
        return room
    return offer


def check_rows(spec: TensorSpec, out: SparseGrad) -> None:
    """SparseGradError unless every row of the sum is one of the tensor's: it was assembled from what
    peers sent, and a trainer that builds a tensor from an out-of-range row writes outside its memory
    (the trainer reads the result unchecked). One pass over the indices, before the commit, so a bad
    peer message fails the step on every node. A backstop: the schemes check every peer message's
    keys as it comes (a PeerMessageError names the sender)."""
    if spec.layout == "dense" or out.nnz == 0:
        return
    low, high = (int(x) for x in torch.aminmax(out.indices))
    if low < 0 or high >= spec.num_rows:
        bad = low if low < 0 else high
        raise SparseGradError(f"the sum of {spec.name!r} holds row {bad}, outside [0, {spec.num_rows}): a peer sent "
                              "a row that is not the tensor's")


RELAYED_CODES = frozenset({codes.ABORTED, codes.INVALID_ARGUMENT, codes.INTERNAL})  # what a peer's abort may carry


def sync_prefix(key: StepKey, attempt: int) -> str:
    """The tag prefix of one attempt of one step (what an abort voids)."""
    return f"{job_key(key.job)}/{key.tensor_id}/{key.step}/{attempt}/"


def as_step_error(exc: Exception, where: str, node: int) -> StepError:
    """The status every trainer of a failed step gets: a lost peer, a timeout, bad data, or a bug.
    Failures across nodes are ABORTED (every node aborts the step; it may be submitted again)."""
    if isinstance(exc, StepError):
        return exc
    if isinstance(exc, CommAborted):  # another node aborted it: its status and reason, as they are
        return StepError(exc.code if exc.code in RELAYED_CODES else codes.ABORTED, str(exc))
    if isinstance(exc, CommTimeout):
        return StepError(codes.ABORTED, f"{where} aborted on node {node}: a peer is alive but slower than the "
                                        f"step timeout: {exc}")
    if isinstance(exc, CommError):
        return StepError(codes.ABORTED, f"{where} aborted on node {node}: peer node lost: {exc}")
    if isinstance(exc, PeerMessageError):
        # bad data from a peer (rank = node): INVALID_ARGUMENT, as a node's own bad row or another node's shape,
        # not ABORTED, which trainers redo: the same step from the same peer would fail again
        log.warning("%s: node %d refused a message: %s", where, node, exc)
        return StepError(codes.INVALID_ARGUMENT, f"{where}: {exc}")
    if isinstance(exc, SparseGradError | ValueError):
        return StepError(codes.INVALID_ARGUMENT, f"{where}: {exc}")
    log.error("internal error in %s", where, exc_info=exc)
    return StepError(codes.INTERNAL, f"{where} on node {node}: internal error {type(exc).__name__}: {exc}")
