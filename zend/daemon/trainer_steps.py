"""Trainer admission and delivery: a trainer's Submit checked, filed with its step, answered.

This is where one gradient enters the daemon (docs/ARCHITECTURE.md): `submit` reads the part
from the trainer's shared buffer (zero copy, every value checked), files it in the StepTable
and waits. The last local trainer to arrive runs the node's step (NodeSteps) on its own handler
thread; each waiting trainer then copies the result into its own result buffer. Steps whose
trainers never come, or whose trainer left, fail here with a status every waiter receives.

One entry, whichever way the step came (zend.protocol.step): `step` waits on the caller's thread
(the buffer socket's doorbell), `step_async` on the event loop (the gRPC Submit, which must not
hold a handler thread while it waits); both are `admit` (checks, files), `run` (the node's step,
by the last trainer to arrive), a wait, `deliver`, and `release` always, and answer a StepResult or
raise a StepError. A job has at most `max_submits_in_flight_per_job` submissions in here at once,
either way; more are RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from zend.core.sparse import SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry, Session, TensorState
from zend.daemon.metrics import DaemonMetrics
from zend.daemon.node_state import NodeState, Phase
from zend.daemon.node_steps import NodeSteps, StepOutcome
from zend.daemon.steps import Step, StepKey, StepTable
from zend.protocol.layout import TensorSpec
from zend.protocol.step import BufferRef, StepRequest, StepResult

log = logging.getLogger("zend.node")
SERVING = NodeState(Phase.SERVING, "")  # a TrainerSteps on its own (tests): always admitting


class Buffer(Protocol):
    nbytes: int

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor: ...

    def publish(self) -> None: ...  # our writes visible to the trainer (a GPU buffer: our stream has run them)

    def acquire(self) -> None: ...  # the trainer's published writes visible to us


BufferLookup = Callable[[str, str], Buffer]  # (session id, buffer id) -> buffer; raises if not that session's


class ResultRoom:
    """A trainer's result buffer offered to the step's scheme (a zend.core.sparse.ResultPlace): the
    sum is assembled where that trainer reads it, and its delivery writes nothing. Each offer stamps
    the buffer (`stamps`), so that a result kept for a late repeat is known to be overwritten once
    a later step (or another tensor) assembled into the same buffer."""

    def __init__(self, spec: TensorSpec, buf: Buffer, offset: int, stamps: weakref.WeakKeyDictionary[Any, int],
                 counter: itertools.count[int]):
        self.spec, self.buf, self.offset = spec, buf, offset
        self._stamps, self._counter = stamps, counter
        self.stamp = -1

    def __call__(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.offset + self.spec.nbytes(rows) > self.buf.nbytes:
            return None  # too small: the scheme allocates, and the delivery says so
        self.stamp = self._stamps[self.buf] = next(self._counter)
        return self.spec.result_views(self.buf.view, self.offset, rows)


@dataclass
class Admitted:
    """A trainer's submission filed with its step (`TrainerSteps.admit`); `release` it once answered."""

    session: Session
    state: TensorState
    step: Step
    out: Buffer
    result_ref: BufferRef  # where in `out` the result goes
    submitted: float
    node: NodeSteps | None  # this trainer was the last to arrive: run the step (`run`) on this node
    released: bool = False


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():  # not given up (timed out, cancelled) meanwhile
        done.set_result(None)


class TrainerSteps:
    """The node's steps as its trainers see them. Admits steps as the node's state says (`state`,
    node_state.py: joining, draining, a generation changing refuse them) and while `open` has given it the
    node's step runner."""

    def __init__(self, registry: JobRegistry, buffers: BufferLookup, metrics: DaemonMetrics, step_timeout_s: float,
                 max_submits_in_flight_per_job: int = 1024, state: Callable[[], NodeState] = lambda: SERVING,
                 learn_step: Callable[[StepKey], None] = lambda key: None):
        self.registry, self.buffers, self.metrics = registry, buffers, metrics
        self.step_timeout_s = step_timeout_s
        self.max_submits_in_flight_per_job = max_submits_in_flight_per_job
        self._in_flight_by_job: dict[str, int] = {}  # job -> its submissions admitted and not yet released
        self.table = StepTable(aborted=self._aborted)
        self.state = state
        self.learn_step = learn_step  # a step failed because this node is behind: a step its tensor reached
        self._node: NodeSteps | None = None
        self._open_by_session: dict[tuple[str, int], int] = {}  # (session, tensor) -> step it waits for
        self._gone: dict[tuple[str, int], str] = {}  # (job, local rank) -> why its trainer left, until replaced
        self._lock = threading.Lock()
        self._stamps: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # buffer -> last offer
        self._offers = itertools.count()

    def open(self, node: NodeSteps) -> None:
        """Run steps on `node` (the node's data plane of this generation)."""
        with self._lock:
            self._node = node

    def _aborted(self, key: StepKey, attempt: int) -> bool:
        node = self._node  # read once: a generation may end meanwhile (its steps are then refused anyway)
        return node is not None and node.aborted(key, attempt)

    def close_node(self) -> None:
        """No step runner until the next `open` (a generation ends)."""
        with self._lock:
            self._node = None

    def end_generation(self, reason: str, timeout_s: float) -> None:
        """After `close_node`: fail the steps not started (ABORTED, naming `reason`), wait up to timeout_s for
        those running (their transport is closed), and start the step table afresh."""
        def error_for(step: Step) -> StepError:
            return StepError(codes.ABORTED, f"step {step.key.step} of tensor {self._tensor_name(step.key)} aborted: "
                                            f"{reason}")
        for step in self.table.abandon(None, error_for):
            assert step.error is not None
            self.metrics.count_error(step.error.code)
        self.wait_in_flight(timeout_s)
        with self._lock:
            self._open_by_session.clear()
        self.table.new_generation()

    def check_accepting(self, what: str) -> None:
        """The node state's refusal of a new request for `what` ("steps", "sessions"), if any: UNAVAILABLE
        while joining or draining, ABORTED for steps while the membership changes (the trainer waits for
        Ready and submits the step again)."""
        refusal = self.state().refusal(what)
        if refusal is not None:
            raise refusal
        if what == "steps" and self._node is None:  # between a generation's end and the next one's start
            raise StepError(codes.UNAVAILABLE, "the daemon is between generations: no steps yet")

    def in_flight(self) -> int:
        return self.table.in_flight()

    # ------------------------------------------------------------------ a trainer's step: the one entry
    def step(self, session: Session, request: StepRequest) -> StepResult:
        """Sum this trainer's part with every other trainer's; the result once it is in the trainer's result
        buffer. Waits on the calling thread (a buffers.sock connection's own). StepError otherwise."""
        return self._result(request.step, self.step_outcome(session, request))

    def step_outcome(self, session: Session, request: StepRequest) -> StepOutcome:
        """`step`, reported as the daemon sees it: the sum's tensors (where they lie) beside the figures."""
        ticket = self.admit(session, request)
        try:
            self.run(ticket)
            self._wait(ticket.step, ticket.state.spec, self._answer_within(request))
            self._done_waiting(ticket)
            return self.deliver(ticket)
        finally:
            self.release(ticket)

    async def step_async(self, session: Session, request: StepRequest) -> StepResult:
        """`step` without holding a thread while it waits (the gRPC Submit, on the server's event loop):
        checked and filed on a handler thread, waited for on the loop, the node's step run on a thread of its
        own, delivered on a handler thread."""
        loop = asyncio.get_running_loop()
        admitting = loop.run_in_executor(None, self.admit, session, request)
        try:
            ticket = await asyncio.shield(admitting)
        except asyncio.CancelledError:  # the caller went away: the part may still be filed, and this
            admitting.add_done_callback(  # trainer may be the last of the step: it runs, then is released
                lambda f: None if f.cancelled() or f.exception() is not None else self._abandon(f.result()))
            raise
        try:
            self.run_elsewhere(ticket)
            await self.wait_async(ticket, self._answer_within(request))
            return self._result(request.step, await loop.run_in_executor(None, self.deliver, ticket))
        finally:
            self.release(ticket)

    @staticmethod
    def _answer_within(request: StepRequest) -> float:
        return max(0.0, request.timeout_s - 0.05)  # answer before the trainer's deadline

    @staticmethod
    def _result(step: int, out: StepOutcome) -> StepResult:
        return StepResult(step, out.grad.nnz, out.scheme, out.bytes_sent, out.bytes_received,
                          out.dense_bytes, dict(out.phases), out.generation, out.nodes)

    def _abandon(self, ticket: Admitted) -> None:
        """A submission whose caller went away while it was filed: its step still runs if this trainer was
        the last to arrive (the other trainers and nodes wait on it), then its quota place is freed."""
        try:
            self.run_elsewhere(ticket)
        finally:
            self.release(ticket)

    def admit(self, session: Session, request: StepRequest) -> Admitted:
        """Check the submission and file its part: quick, never waits. The caller must `release` it."""
        submitted = time.perf_counter()
        state = self.registry.tensor(session.job, request.tensor)
        buf = self._input_buffer(session, state.spec, request.input, request.nnz)
        out = self._buffer(session, request.result.buffer, "result")
        part = self._read(state.spec, buf, request.input.offset, request.nnz)
        step, node = self._join(session, state, request.step, part)
        return Admitted(session, state, step, out, request.result, submitted, node)

    def run(self, ticket: Admitted) -> None:
        """Run the node's step here if this submission completed it (else nothing)."""
        node, ticket.node = ticket.node, None
        if node is not None:
            self._run(node, ticket.state, ticket.step, self._room(ticket))

    def run_elsewhere(self, ticket: Admitted) -> None:
        """`run` on a thread of its own: the step may wait for other nodes for as long as the step timeout."""
        if ticket.node is None:
            return
        try:
            threading.Thread(target=self.run, args=(ticket,), name="zend-step", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: the step fails everywhere instead of never running
            ticket.node = None
            err = StepError(codes.RESOURCE_EXHAUSTED, f"step {ticket.step.key.step} of tensor "
                                                      f"{ticket.state.spec.name!r}: no thread to run it ({exc})")
            self.table.finish(ticket.step, error=err)
            self._abort_everywhere(ticket.step, err)

    async def wait_async(self, ticket: Admitted, wait_s: float) -> None:
        """`_wait` on the event loop: no thread is held while the step is summed elsewhere."""
        step, limit = ticket.step, self._limit(wait_s)
        if not step.done.is_set():
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()

            def wake() -> None:  # on the thread that finished the step
                with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
                    loop.call_soon_threadsafe(_resolve, done)
            self.table.when_done(step, wake)
            try:
                await asyncio.wait_for(done, limit)
            except TimeoutError:
                raise self._late(step, ticket.state.spec, limit) from None
        self._done_waiting(ticket)

    def deliver(self, ticket: Admitted) -> StepOutcome:
        """After the wait: the step's error, or its outcome written into the trainer's result buffer."""
        step = ticket.step
        if step.error is not None:  # each waiter its own copy: a shared one would gather every waiter's frames
            raise StepError(step.error.code, step.error.message) from None
        outcome: StepOutcome = step.result
        room = outcome.placed
        if isinstance(room, ResultRoom):  # assembled in a result buffer: nothing to write if it is this one
            self._check_held(room, ticket)
            if ticket.out is room.buf and ticket.result_ref.offset == room.offset:
                room.buf.publish()
                self.metrics.record_delivery(outcome.scheme, 0.0)
                self.metrics.record_trainer_step(ticket.state.spec.job, outcome.scheme,
                                                 time.perf_counter() - ticket.submitted)
                return outcome
        self._deliver(ticket.state.spec, outcome, ticket.out, ticket.result_ref)
        if isinstance(room, ResultRoom):
            self._check_held(room, ticket)  # not overwritten while it was copied either
        self.metrics.record_trainer_step(ticket.state.spec.job, outcome.scheme,
                                         time.perf_counter() - ticket.submitted)
        return outcome

    def _check_held(self, room: ResultRoom, ticket: Admitted) -> None:
        """A kept result (for a late repeat) lies in a result buffer that a later step may have reused."""
        if self._stamps.get(room.buf) != room.stamp:
            raise StepError(codes.FAILED_PRECONDITION, f"step {ticket.step.key.step} of tensor "
                                                       f"{ticket.state.spec.name!r} is over, and its result "
                                                       "buffer holds a later result now: this trainer is behind")

    def _done_waiting(self, ticket: Admitted) -> None:
        with self._lock:  # done (or given up by this trainer, in `release`): its next step may come
            self._open_by_session.pop((ticket.session.session_id, ticket.state.tensor_id), None)

    def release(self, ticket: Admitted) -> None:
        """The submission is answered (or given up): it no longer counts towards its job's quota. Idempotent."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._open_by_session.pop((ticket.session.session_id, ticket.state.tensor_id), None)
            job = ticket.session.job
            left = self._in_flight_by_job.get(job, 0) - 1
            if left > 0:
                self._in_flight_by_job[job] = left
            else:
                self._in_flight_by_job.pop(job, None)

    def _buffer(self, session: Session, buffer_id: str, what: str) -> Buffer:
        try:
            return self.buffers(session.session_id, buffer_id)
        except (KeyError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, f"{what} buffer {buffer_id!r}: {exc}") from None

    def _input_buffer(self, session: Session, spec: TensorSpec, ref: BufferRef, nnz: int) -> Buffer:
        """The trainer's input buffer, if it holds the `nnz` rows it claims to."""
        buf = self._buffer(session, ref.buffer, "input")
        need = spec.nbytes(nnz)
        if nnz > 1 << 40 or ref.offset + need > buf.nbytes:
            raise StepError(codes.INVALID_ARGUMENT, f"input buffer {ref.buffer!r} holds {buf.nbytes} bytes; "
                                                    f"offset {ref.offset} + {need} bytes for nnz={nnz} of tensor "
                                                    f"{spec.name!r} do not fit")
        return buf

    @staticmethod
    def _read(spec: TensorSpec, buf: Buffer, offset: int, nnz: int) -> SparseGrad:
        """A zero-copy view of the part, every index and value checked (the trainer may have written anything)."""
        try:
            buf.acquire()
            return spec.read(buf.view, offset, nnz)
        except (SparseGradError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, str(exc)) from None

    def _join(self, session: Session, state: TensorState, step_no: int, part: SparseGrad) -> tuple[Step,
                                                                                                   NodeSteps | None]:
        """File the part; returns the step, and the node to run it on if this trainer was the last to arrive."""
        key = StepKey(session.job, state.tensor_id, step_no)
        with self._lock:
            self.check_accepting("steps")
            waiting = self._open_by_session.get((session.session_id, state.tensor_id))
            if waiting is not None and waiting != step_no:
                raise StepError(codes.FAILED_PRECONDITION, f"step {waiting} of tensor {state.spec.name!r} is still "
                                                           f"in flight for this trainer; submit {step_no} after it")
            held = self._in_flight_by_job.get(session.job, 0)
            if held >= self.max_submits_in_flight_per_job:
                raise StepError(codes.RESOURCE_EXHAUSTED, f"job {session.job!r} has {held} steps waiting in the "
                                                          f"daemon on this node, its quota "
                                                          f"(max_submits_in_flight_per_job "
                                                          f"{self.max_submits_in_flight_per_job}); step {step_no} of "
                                                          f"tensor {state.spec.name!r} is refused")
            node = self._node
            assert node is not None  # check_accepting refused the step otherwise
            try:
                step, start = self.table.join(key, session.local_rank, session.session_id, part,
                                              state.local_world_size)
            except StepError as exc:
                if exc.job_step is not None:  # this trainer is behind its node's others: where the job is
                    self.learn_step(StepKey(session.job, state.tensor_id, exc.job_step))
                raise
            overtaken = []  # its node's trainers are behind this one (restarted, a result lost): tell them
            for earlier in self.table.overtaken(key):
                behind = StepError(codes.ABORTED, f"step {earlier.key.step} of tensor {state.spec.name!r} aborted: "
                                                  f"local rank {session.local_rank} of this node is at step "
                                                  f"{step_no}; the job is at step {step_no}", job_step=step_no)
                self.table.finish(earlier, error=behind)  # under _lock: no late trainer can start it meanwhile
                overtaken.append((earlier, behind))
            if overtaken:
                self.learn_step(key)
            self._open_by_session[(session.session_id, state.tensor_id)] = step_no
            self._in_flight_by_job[session.job] = held + 1
            vacant = None if start or step.done.is_set() else self._vacancy(session.job)
            err = None
            if vacant is not None:  # a trainer of this step left and nobody took its place: it cannot start
                err = StepError(codes.ABORTED, f"step {step_no} of tensor {state.spec.name!r} aborted: {vacant}")
                self.table.finish(step, error=err)  # under _lock: no other trainer can start it meanwhile
        if err is not None:
            try:
                self._abort_everywhere(step, err)
            except Exception:  # the step has its error already; the caller must still get its ticket
                log.exception("aborting step %s of tensor %r everywhere", step_no, state.spec.name)
        for earlier, behind in overtaken:
            with contextlib.suppress(Exception):  # the step has its error; the others must still hear of it
                self._abort_everywhere(earlier, behind)
        return step, (node if start else None)

    def open_steps_of(self, job: str) -> dict[int, int]:
        """tensor id -> the highest step of it a trainer of this node submitted for `job` that has not ended."""
        return self.table.highest_open(job)

    def vacancy(self, job: str) -> str | None:
        """Why `job` cannot step on this node until a trainer takes a place its trainer left, or None (Ready waits
        on it: a redo before the place is taken would only be aborted again)."""
        with self._lock:
            why = self._vacancy(job)
        return None if why is None else f"{why}; waiting for a trainer to take its place"

    def _vacancy(self, job: str) -> str | None:
        """(under _lock) Why a local rank of `job` is empty: its trainer left and no session holds it."""
        gone = [(rank, why) for (j, rank), why in self._gone.items() if j == job]
        if not gone:
            return None
        held = {s.local_rank for s in self.registry.session_list() if s.job == job}
        for rank, why in gone:
            if rank in held:  # a restarted trainer took the place
                del self._gone[(job, rank)]
            else:
                return why
        return None

    def _limit(self, wait_s: float) -> float:
        # past the step timeout: the step's own failure (the same on every node) comes first
        return min(wait_s, self.step_timeout_s + 2.0)

    def _wait(self, step: Step, spec: TensorSpec, wait_s: float) -> None:
        limit = self._limit(wait_s)
        if not step.done.wait(limit):
            raise self._late(step, spec, limit)

    @staticmethod
    def _late(step: Step, spec: TensorSpec, limit: float) -> StepError:
        missing = step.missing()
        who = f"local trainers {missing} have not submitted it" if missing else "the nodes are still summing it"
        return StepError(codes.DEADLINE_EXCEEDED, f"step {step.key.step} of tensor {spec.name!r} not done in "
                                                  f"{limit:.3g} s: {who}")

    def _deliver(self, spec: TensorSpec, outcome: StepOutcome, out: Buffer, ref: BufferRef) -> None:
        t0 = time.perf_counter()
        need = spec.nbytes(outcome.grad.nnz)
        if ref.offset + need > out.nbytes:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"result buffer {ref.buffer!r} holds {out.nbytes} bytes; "
                                                      f"the result needs {need} from offset {ref.offset} "
                                                      f"(submit the step again with a larger one)")
        spec.write(outcome.grad, out.view, ref.offset)
        out.publish()  # before the answer: the trainer reads as soon as it has it
        self.metrics.record_delivery(outcome.scheme, time.perf_counter() - t0)

    # ------------------------------------------------------------------ the step
    def _room(self, ticket: Admitted) -> ResultRoom | None:
        """The result buffer of the trainer that runs the step, when the scheme can assemble into it:
        sparse rows in CPU memory (a dense result is zero-filled and scattered by `write`), and the
        node's only trainer of the job (with more, the others would copy out of a buffer whose owner,
        answered first, may already be changing it)."""
        spec = ticket.state.spec
        if (spec.layout == "dense" or ticket.state.local_world_size != 1
                or getattr(ticket.out, "device", "cpu") != "cpu"):
            return None
        return ResultRoom(spec, ticket.out, ticket.result_ref.offset, self._stamps, self._offers)

    def _run(self, node: NodeSteps, state: TensorState, step: Step, room: ResultRoom | None = None) -> None:
        key = step.key
        try:
            outcome = node.run(state, key, [step.parts[r] for r in sorted(step.parts)],
                               waited_s=time.monotonic() - step.opened_at, attempt=step.attempt, place=room)
        except Exception as exc:  # every waiting trainer gets it
            err = exc if isinstance(exc, StepError) else StepError(
                codes.INTERNAL, f"step {key.step} of tensor {state.spec.name!r}: internal error "
                                f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, StepError):
                log.exception("step %s of tensor %r failed", key.step, state.spec.name)
            if err.job_step is not None:  # before the error is out: the trainers' wait_ready must see it
                self.learn_step(StepKey(key.job, key.tensor_id, err.job_step))
            self.metrics.count_error(err.code)
            log.warning("step failed", extra={"event": "step_failed", "job": key.job, "tensor": state.spec.name,
                                              "step": key.step, "code": err.code, "error": err.message})
            self.table.finish(step, error=err)
            return
        self.table.finish(step, result=outcome)  # trainers go on; the bookkeeping comes after
        try:
            self._record(state, key, outcome)
        except Exception:  # bookkeeping must never fail a step that succeeded
            log.exception("recording step %s of tensor %r", key.step, state.spec.name)

    def _record(self, state: TensorState, key: StepKey, outcome: StepOutcome) -> None:
        spec = state.spec
        self.metrics.record_step(spec.job, spec.name, outcome)
        self.registry.step_completed(state, key.step, outcome)
        # DEBUG, not INFO: a JSON line per step cost 0.3 ms of the step; the metrics carry the same
        log.debug("step done", extra={"event": "step_done", "job": spec.job, "tensor": spec.name, "step": key.step,
                                     "scheme": outcome.scheme, "nnz_in": outcome.nnz_in,
                                     "nnz_out": outcome.grad.nnz, "bytes_sent": outcome.bytes_sent,
                                     "seconds": round(outcome.seconds, 6)})

    # ------------------------------------------------------------------ steps that cannot finish
    @property
    def _node_rank(self) -> int:
        return self._node.comm.rank if self._node is not None else 0

    def _tensor_name(self, key: StepKey) -> str:
        try:
            return repr(self.registry.tensor(key.job, key.tensor_id).spec.name)
        except Exception:  # the job is gone already
            return f"#{key.tensor_id}"

    def _abort_everywhere(self, step: Step, err: StepError) -> None:
        """A step that failed here before it ran: every other node aborts it too (they may be waiting on us)."""
        self.metrics.count_error(err.code)
        log.warning("step aborted", extra={"event": "step_aborted", "job": step.key.job, "step": step.key.step,
                                           "code": err.code, "error": err.message})
        node = self._node
        if node is not None and step.generation == self.table.generation:  # never into a newer generation
            node.abort(step.key, step.attempt, err)

    def session_closed(self, session: Session) -> None:
        """A trainer left (or died): steps waiting for it fail now, on every node, instead of at their deadline."""
        node = self._node_rank
        gone = (f"trainer local rank {session.local_rank} (pid {session.pid}) of job {session.job!r} on node {node} "
                "disconnected before the step could start")

        def error_for(step: Step) -> StepError:
            return StepError(codes.ABORTED, f"step {step.key.step} of tensor {self._tensor_name(step.key)} aborted: "
                                            f"{gone}")
        with self._lock:  # steps that open before a trainer takes its place fail at once, alike
            last_here = not any(s.job == session.job for s in self.registry.session_list())
            if not last_here:
                self._gone[(session.job, session.local_rank)] = gone
            else:  # the job's last trainer here left (its end, or all restart): nothing is vacant
                for key in [k for k in self._gone if k[0] == session.job]:
                    del self._gone[key]
            while len(self._gone) > 4096:
                del self._gone[next(iter(self._gone))]
        for step in self.table.abandon(session.job, error_for):
            assert step.error is not None
            self._abort_everywhere(step, step.error)
        if last_here:  # its steps that run already: nobody here takes their results, and a job whose trainers
            # all restarted must not join them (a dead life's parts would be summed into the new life's step)
            for step in self.table.open_steps(session.job, started=True):
                self._abort_everywhere(step, StepError(
                    codes.ABORTED, f"step {step.key.step} of tensor {self._tensor_name(step.key)} aborted: every "
                                   f"trainer of job {session.job!r} on node {node} left while it ran"))
        with self._lock:
            for key in [k for k in self._open_by_session if k[0] == session.session_id]:
                del self._open_by_session[key]

    def expire(self) -> None:
        """Fail steps whose local trainers did not all come within the step timeout, on every node."""
        node = self._node_rank

        def error_for(step: Step) -> StepError:
            return StepError(codes.ABORTED, f"step {step.key.step} of tensor {self._tensor_name(step.key)} aborted: "
                                            f"local trainers {step.missing()} of node {node} never submitted it "
                                            f"within the step timeout ({self.step_timeout_s:g} s)")
        for step in self.table.expire(self.step_timeout_s, error_for):
            assert step.error is not None
            self._abort_everywhere(step, step.error)

    def wait_in_flight(self, timeout_s: float) -> tuple[int, int]:
        """Wait for the steps in flight (a drain: the node state refuses new ones). Returns (completed, abandoned)."""
        pending = self.table.open_steps()
        deadline = time.monotonic() + timeout_s
        for step in pending:
            step.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = sum(1 for step in pending if not step.done.is_set())
        return len(pending) - abandoned, abandoned
