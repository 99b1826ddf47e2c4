"""Which trainers have submitted which step: the node's half of "each step exactly once".

Pure bookkeeping (no I/O, no gRPC): a step of a tensor opens when its first trainer submits,
starts when all `expected` local trainers have, and ends with a result or an error that every
submitter receives. A repeated submission joins the same step (idempotent); the last finished
step of each tensor is kept so that a late repeat still gets its result.

A step that failed may be submitted again: that is a new *attempt* of it (a number every node
counts alike, since every node aborts a failed step), and its messages are tagged with it, so
nothing of the failed attempt can mix into the new one. A step a peer aborted before it opened here
(its trainers there left, or were late) failed on every node too: it opens here at the attempt after the
ones aborted (`aborted`, what the node's transport was told), the attempt the other nodes redo it as.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zend.daemon.errors import ABORTED, FAILED_PRECONDITION, INVALID_ARGUMENT, StepError

MAX_STEP = 2**62  # step numbers are counters: anything near 2**63 is a bug or an attack
STEP_WINDOW = 1 << 20  # how far past a tensor's last synchronised step a submission may jump


@dataclass(frozen=True)
class StepKey:
    job: str
    tensor_id: int
    step: int


@dataclass
class Step:
    key: StepKey
    expected: int
    attempt: int = 0  # how many times this step failed before (on every node alike)
    generation: int = 0  # the table's generation when it opened: a later one ignores its outcome
    opened_at: float = field(default_factory=time.monotonic)
    parts: dict[int, Any] = field(default_factory=dict)  # local rank -> that trainer's gradient
    sessions: dict[int, str] = field(default_factory=dict)  # local rank -> session id
    started: bool = False
    result: Any = None
    error: StepError | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: list[Callable[[], None]] = field(default_factory=list)  # called once it is done (StepTable.when_done)

    def missing(self) -> list[int]:
        return sorted(set(range(self.expected)) - set(self.parts))


class StepTable:
    """Open and recently finished steps of every tensor on this node."""

    def __init__(self, aborted: Callable[[StepKey, int], bool] = lambda key, attempt: False) -> None:
        self._aborted = aborted  # (step, attempt) -> whether that attempt was aborted, by any node
        self._lock = threading.Lock()
        self._open: dict[StepKey, Step] = {}
        self._last: dict[tuple[str, int], Step] = {}  # (job, tensor) -> last step that succeeded
        self._attempts: dict[StepKey, int] = {}  # failed attempts of steps not yet succeeded
        self.generation = 0  # bumped by new_generation: steps of an older one leave no trace

    def join(self, key: StepKey, local_rank: int, session: str, part: Any, expected: int) -> tuple[Step, bool]:
        """File a trainer's part; returns the step and whether this call completed it (start it now)."""
        if not 0 <= key.step < MAX_STEP:
            raise StepError(INVALID_ARGUMENT, f"step {key.step} of tensor {key.tensor_id} is outside [0, 2**62)")
        with self._lock:
            last = self._last.get((key.job, key.tensor_id))
            if last is not None and last.key.step == key.step:
                return last, False  # a repeat after the end: the same result (or error)
            if last is not None and key.step > last.key.step + STEP_WINDOW:  # it would wedge the tensor
                raise StepError(INVALID_ARGUMENT, f"step {key.step} of tensor {key.tensor_id} is more than "
                                                  f"{STEP_WINDOW} past its last synchronised step {last.key.step}")
            if last is not None and key.step < last.key.step:
                raise StepError(FAILED_PRECONDITION, f"step {key.step} of tensor {key.tensor_id} is in the past: "
                                                     f"step {last.key.step} has already been synchronised")
            step = self._open.get(key)
            if step is None:
                for other in self._open.values():
                    if (other.key.job, other.key.tensor_id) == (key.job, key.tensor_id) and other.key.step > key.step:
                        if local_rank not in other.parts:  # other trainers of this node got step key.step's
                            raise StepError(ABORTED, f"local rank(s) {sorted(other.parts)} of this node are at "
                                                     f"step {other.key.step} of tensor {key.tensor_id}: step "
                                                     f"{key.step} finished while this trainer restarted, and "
                                                     f"its result is lost here; the job is at step "
                                                     f"{other.key.step}", job_step=other.key.step)
                        raise StepError(FAILED_PRECONDITION,
                                        f"step {key.step} of tensor {key.tensor_id} arrived after step "
                                        f"{other.key.step} opened; steps of a tensor must come in order")
                attempt = self._attempts.get(key, 0)
                while self._aborted(key, attempt):  # a peer aborted it before it opened here
                    attempt += 1
                step = self._open[key] = Step(key, expected, attempt, self.generation)
            if step.expected != expected:
                raise StepError(FAILED_PRECONDITION, f"local world size {expected} differs from {step.expected} "
                                                     f"given by the other trainers of step {key.step}")
            if local_rank in step.parts or step.started:
                return step, False  # a repeat while in flight: wait for the same outcome
            step.parts[local_rank] = part
            step.sessions[local_rank] = session
            if len(step.parts) == step.expected:
                step.started = True
                return step, True
            return step, False

    def finish(self, step: Step, result: Any = None, error: StepError | None = None) -> None:
        if error is not None:  # kept as words: its frames (and its context's) hold the parts, views into
            error.__traceback__ = error.__context__ = error.__cause__ = None  # trainers' buffers, in cycles
            # that only the garbage collector breaks, keeping a closed session's memory until it runs
        with self._lock:
            step.result, step.error = result, error
            step.parts = {}  # drop the views into trainers' buffers
            if self._open.get(step.key) is step:
                del self._open[step.key]
            if step.generation == self.generation:  # one that outlived its generation leaves nothing
                self._remember(step, error)
            step.done.set()
            callbacks, step.on_done = step.on_done, []
        for callback in callbacks:
            callback()

    def when_done(self, step: Step, callback: Callable[[], None]) -> None:
        """Call `callback` (on the finishing thread; it must be quick) once `step` is done: now if it is."""
        with self._lock:
            if not step.done.is_set():
                step.on_done.append(callback)
                return
        callback()

    def _remember(self, step: Step, error: StepError | None) -> None:
        """(under _lock) A success is kept for repeats and ends the tensor's attempt counts; a failure
        makes the next submission of the step a new attempt."""
        if error is None:
            self._last[(step.key.job, step.key.tensor_id)] = step
            done = step.key
            for key in [k for k in self._attempts
                        if (k.job, k.tensor_id) == (done.job, done.tensor_id) and k.step <= done.step]:
                del self._attempts[key]
        else:
            self._attempts[step.key] = step.attempt + 1

    def abandon(self, job: str | None, error_for: Any) -> list[Step]:
        """A job's trainer is gone (job None: the node's membership changes): fail that job's steps that
        have not started (they hold its part, or wait for it in vain), each with error_for(step)."""
        with self._lock:
            victims = [s for s in self._open.values() if not s.started and job in (None, s.key.job)]
        for step in victims:
            self.finish(step, error=error_for(step))
        return victims

    def expire(self, older_than_s: float, error_for: Any) -> list[Step]:
        """Fail steps that waited longer than `older_than_s` for their trainers (error_for(step))."""
        now = time.monotonic()
        with self._lock:
            victims = [s for s in self._open.values() if not s.started and now - s.opened_at > older_than_s]
        for step in victims:
            self.finish(step, error=error_for(step))
        return victims

    def new_generation(self) -> None:
        """A new membership generation starts every tensor afresh: no kept results (a node that joined
        has none, and a step redone after the change runs again on every node), attempts from 0."""
        with self._lock:
            self.generation += 1
            self._last.clear()
            self._attempts.clear()
            self._open.clear()  # steps still running (past the wait) finish on their own, out of the table

    def overtaken(self, key: StepKey) -> list[Step]:
        """The tensor's earlier steps still waiting for trainers, now that one of them submitted `key`: the
        others' parts can never come (a trainer behind them, restarted, lost a result they got)."""
        with self._lock:
            return [s for s in self._open.values() if (s.key.job, s.key.tensor_id) == (key.job, key.tensor_id)
                    and s.key.step < key.step and not s.started]

    def highest_open(self, job: str) -> dict[int, int]:
        """tensor id -> the highest step of it (of `job`) a trainer of this node submitted that has not ended."""
        with self._lock:
            found: dict[int, int] = {}
            for s in self._open.values():
                if s.key.job == job:
                    found[s.key.tensor_id] = max(found.get(s.key.tensor_id, s.key.step), s.key.step)
            return found

    def in_flight(self) -> int:
        with self._lock:
            return len(self._open)

    def entries(self) -> int:
        """Every entry the table holds (open steps, kept results, attempt counts): bounded by tensors."""
        with self._lock:
            return len(self._open) + len(self._last) + len(self._attempts)

    def open_steps(self, job: str | None = None, started: bool | None = None) -> list[Step]:
        """The steps not ended: of `job` (None: any), started or not (None: both)."""
        with self._lock:
            return [s for s in self._open.values()
                    if job in (None, s.key.job) and started in (None, s.started)]
