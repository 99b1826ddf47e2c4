"""Trainer admission and delivery: a trainer's Submit checked, filed with its step, answered.

This is where one gradient enters the daemon (docs/ARCHITECTURE.md): `submit` reads the part
from the trainer's shared buffer (zero copy, every value checked), files it in the StepTable
and waits. The last local trainer to arrive runs the node's step (NodeSteps) on its own handler
thread; each waiting trainer then copies the result into its own result buffer. Steps whose
trainers never come, or whose trainer left, fail here with a status every waiter receives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from zend.core.sparse import SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry, Session, TensorState
from zend.daemon.metrics import DaemonMetrics
from zend.daemon.node_steps import NodeSteps, StepOutcome
from zend.daemon.steps import Step, StepKey, StepTable
from zend.protocol.layout import TensorSpec

log = logging.getLogger("zend.node")


class Buffer(Protocol):
    nbytes: int

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor: ...


BufferLookup = Callable[[str, str], Buffer]  # (session id, buffer id) -> buffer; raises if not that session's
BufferRef = tuple[str, int]  # (buffer id, byte offset)


class TrainerSteps:
    """The node's steps as its trainers see them. Refuses steps until `open` gives it the node's
    step runner (the daemon is still joining its cluster) and after `draining` is set."""

    def __init__(self, registry: JobRegistry, buffers: BufferLookup, metrics: DaemonMetrics, step_timeout_s: float):
        self.registry, self.buffers, self.metrics = registry, buffers, metrics
        self.step_timeout_s = step_timeout_s
        self.table = StepTable()
        self.draining = False
        self._node: NodeSteps | None = None
        self._open_by_session: dict[tuple[str, int], int] = {}  # (session, tensor) -> step it waits for
        self._gone: dict[tuple[str, int], str] = {}  # (job, local rank) -> why its trainer left, until replaced
        self.changing: str | None = None  # why the membership is changing (steps refused until `open`)
        self._lock = threading.Lock()

    def open(self, node: NodeSteps) -> None:
        """Start admitting steps, run by `node`."""
        with self._lock:
            self._node, self.changing = node, None

    def refuse(self, reason: str) -> None:
        """The node's membership changes: new steps are refused (ABORTED, naming `reason`) until `open`."""
        with self._lock:
            self._node, self.changing = None, reason

    def end_generation(self, timeout_s: float) -> None:
        """After `refuse`: fail the steps not started, wait up to timeout_s for those running (their
        transport is closed), and start the step table afresh."""
        reason = self.changing

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
        """UNAVAILABLE while the daemon is joining its cluster or draining; ABORTED while its membership
        changes (the trainer waits for Ready and submits the step again)."""
        if self.draining:
            raise StepError(codes.UNAVAILABLE, f"the daemon is draining: no new {what}")
        changing = self.changing
        if changing is not None and what == "steps":
            raise StepError(codes.ABORTED, f"no new steps while the membership changes ({changing}): wait until "
                                           "the daemon is ready (zen.Client.wait_ready) and submit the step again")
        if self._node is None:
            raise StepError(codes.UNAVAILABLE, f"the daemon is still joining its cluster: no {what} yet")

    def not_running(self) -> str | None:
        """Why steps are refused apart from a drain (still joining, membership changing), or None."""
        changing = self.changing
        if changing is not None:
            return f"the membership is changing ({changing})"
        if self._node is None:
            return "the daemon is still joining its cluster"
        return None

    def in_flight(self) -> int:
        return self.table.in_flight()

    # ------------------------------------------------------------------ a trainer's submission
    def submit(self, session: Session, tid: int, step_no: int, input_ref: BufferRef, nnz: int, result_ref: BufferRef,
               wait_s: float) -> StepOutcome:
        """Sum this trainer's part with every other trainer's; the outcome once it is in `result_ref`."""
        submitted = time.perf_counter()
        state = self.registry.tensor(session.job, tid)
        buf = self._input_buffer(session, state.spec, input_ref, nnz)
        out = self._buffer(session, result_ref[0], "result")
        step = self._join(session, state, step_no, self._read(state.spec, buf, input_ref[1], nnz))
        try:
            self._wait(step, state.spec, wait_s)
        finally:
            with self._lock:  # done, or given up by this trainer: its next step may come
                self._open_by_session.pop((session.session_id, tid), None)
        if step.error is not None:
            raise step.error
        outcome: StepOutcome = step.result
        self._deliver(state.spec, outcome, out, result_ref)
        self.metrics.record_trainer_step(outcome.scheme, time.perf_counter() - submitted)
        return outcome

    def _buffer(self, session: Session, buffer_id: str, what: str) -> Buffer:
        try:
            return self.buffers(session.session_id, buffer_id)
        except (KeyError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, f"{what} buffer {buffer_id!r}: {exc}") from None

    def _input_buffer(self, session: Session, spec: TensorSpec, ref: BufferRef, nnz: int) -> Buffer:
        """The trainer's input buffer, if it holds the `nnz` rows it claims to."""
        buf = self._buffer(session, ref[0], "input")
        need = spec.nbytes(nnz)
        if nnz > 1 << 40 or ref[1] + need > buf.nbytes:
            raise StepError(codes.INVALID_ARGUMENT, f"input buffer {ref[0]!r} holds {buf.nbytes} bytes; "
                                                    f"offset {ref[1]} + {need} bytes for nnz={nnz} of tensor "
                                                    f"{spec.name!r} do not fit")
        return buf

    @staticmethod
    def _read(spec: TensorSpec, buf: Buffer, offset: int, nnz: int) -> SparseGrad:
        """A zero-copy view of the part, every index and value checked (the trainer may have written anything)."""
        try:
            return spec.read(buf.view, offset, nnz)
        except (SparseGradError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, str(exc)) from None

    def _join(self, session: Session, state: TensorState, step_no: int, part: SparseGrad) -> Step:
        """File the part; the last local trainer to arrive runs the step here, on its own thread."""
        key = StepKey(session.job, state.tensor_id, step_no)
        with self._lock:
            self.check_accepting("steps")
            waiting = self._open_by_session.get((session.session_id, state.tensor_id))
            if waiting is not None and waiting != step_no:
                raise StepError(codes.FAILED_PRECONDITION, f"step {waiting} of tensor {state.spec.name!r} is still "
                                                           f"in flight for this trainer; submit {step_no} after it")
            node = self._node
            assert node is not None  # check_accepting refused the step otherwise
            step, start = self.table.join(key, session.local_rank, session.session_id, part,
                                          state.local_world_size)
            self._open_by_session[(session.session_id, state.tensor_id)] = step_no
            vacant = None if start or step.done.is_set() else self._vacancy(session.job)
            err = None
            if vacant is not None:  # a trainer of this step left and nobody took its place: it cannot start
                err = StepError(codes.ABORTED, f"step {step_no} of tensor {state.spec.name!r} aborted: {vacant}")
                self.table.finish(step, error=err)  # under _lock: no other trainer can start it meanwhile
        if err is not None:
            self._abort_everywhere(step, err)
        elif start:
            self._run(node, state, step)
        return step

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

    def _wait(self, step: Step, spec: TensorSpec, wait_s: float) -> None:
        # past the step timeout: the step's own failure (the same on every node) comes first
        limit = min(wait_s, self.step_timeout_s + 2.0)
        if not step.done.wait(limit):
            missing = step.missing()
            who = f"local trainers {missing} have not submitted it" if missing else "the nodes are still summing it"
            raise StepError(codes.DEADLINE_EXCEEDED, f"step {step.key.step} of tensor {spec.name!r} not done in "
                                                     f"{limit:.3g} s: {who}")

    def _deliver(self, spec: TensorSpec, outcome: StepOutcome, out: Buffer, ref: BufferRef) -> None:
        t0 = time.perf_counter()
        need = spec.nbytes(outcome.grad.nnz)
        if ref[1] + need > out.nbytes:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"result buffer {ref[0]!r} holds {out.nbytes} bytes; "
                                                      f"the result needs {need} from offset {ref[1]} "
                                                      f"(submit the step again with a larger one)")
        spec.write(outcome.grad, out.view, ref[1])
        self.metrics.record_delivery(outcome.scheme, time.perf_counter() - t0)

    # ------------------------------------------------------------------ the step
    def _run(self, node: NodeSteps, state: TensorState, step: Step) -> None:
        key = step.key
        try:
            outcome = node.run(state, key, [step.parts[r] for r in sorted(step.parts)],
                                     waited_s=time.monotonic() - step.opened_at, attempt=step.attempt)
        except StepError as err:  # every waiting trainer gets it
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
        state.stats.record(key.step, outcome)
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
            if any(s.job == session.job for s in self.registry.session_list()):
                self._gone[(session.job, session.local_rank)] = gone
            else:  # the job's last trainer here left (its end, or all restart): nothing is vacant
                for key in [k for k in self._gone if k[0] == session.job]:
                    del self._gone[key]
            while len(self._gone) > 4096:
                del self._gone[next(iter(self._gone))]
        for step in self.table.abandon(session.job, error_for):
            assert step.error is not None
            self._abort_everywhere(step, step.error)
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
        """Wait for the steps in flight (a drain: `draining` is set). Returns (completed, abandoned)."""
        pending = self.table.open_steps()
        deadline = time.monotonic() + timeout_s
        for step in pending:
            step.done.wait(max(0.0, deadline - time.monotonic()))
        abandoned = sum(1 for step in pending if not step.done.is_set())
        return len(pending) - abandoned, abandoned
