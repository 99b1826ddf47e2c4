"""The node's step engine: gather the local trainers' parts, sum them, sum across nodes, deliver.

This is where one gradient crosses the daemon (docs/ARCHITECTURE.md): a trainer's Submit
lands in `submit`, which reads the part from the trainer's shared buffer (zero copy), files it
in the StepTable and waits. The last local trainer to arrive starts `_run`: local sum, a
one-time check that every node describes the tensor alike, the scheme over the data plane,
and the result; each waiting trainer then copies it into its own result buffer.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zend.core.comm import Channel, CommError, CommTimeout, Communicator
from zend.core.sparse import SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry, Session, TensorState, job_key
from zend.daemon.metrics import DaemonMetrics
from zend.daemon.steps import Step, StepKey, StepTable
from zend.daemon.tensors import local_sum

log = logging.getLogger("zend.node")


class Buffer(Protocol):
    nbytes: int

    def view(self, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor: ...


BufferLookup = Callable[[str, str], Buffer]  # (session id, buffer id) -> buffer; raises if not that session's


@dataclass
class StepOutcome:
    grad: SparseGrad
    scheme: str
    bytes_sent: int
    bytes_received: int
    dense_bytes: int
    phases: dict[str, float] = field(default_factory=dict)


class CountingComm(Communicator):
    """The data plane, counting payload bytes per peer for the metrics."""

    def __init__(self, inner: Communicator, metrics: DaemonMetrics):
        self.inner, self.metrics = inner, metrics
        self.rank, self.world_size = inner.rank, inner.world_size

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        self.inner.send(dst, tag, payload)
        self.metrics.bytes_sent.labels(peer=str(dst)).inc(payload.numel() * payload.element_size())

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        payload = self.inner.recv(src, tag, timeout_s)
        self.metrics.bytes_received.labels(peer=str(src)).inc(payload.numel() * payload.element_size())
        return payload


class NodeSync:
    def __init__(self, comm: Communicator, registry: JobRegistry, buffers: BufferLookup, metrics: DaemonMetrics,
                 step_timeout_s: float):
        self.comm = CountingComm(comm, metrics)
        self.registry, self.buffers, self.metrics = registry, buffers, metrics
        self.step_timeout_s = step_timeout_s
        self.table = StepTable()
        self.draining = False
        self._open_by_session: dict[tuple[str, int], int] = {}  # (session, tensor) -> step it waits for
        self._lock = threading.Lock()

    @property
    def node(self) -> int:
        return self.comm.rank

    # ------------------------------------------------------------------ trainer side
    def _buffer(self, session: Session, buffer_id: str, what: str) -> Buffer:
        try:
            return self.buffers(session.session_id, buffer_id)
        except (KeyError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, f"{what} buffer {buffer_id!r}: {exc}") from None

    def submit(self, session: Session, tid: int, step_no: int, input_ref: tuple[str, int], nnz: int,
               result_ref: tuple[str, int], wait_s: float) -> StepOutcome:
        state = self.registry.tensor(session.job, tid)
        spec = state.spec
        buf = self._buffer(session, input_ref[0], "input")
        need = spec.nbytes(nnz)
        if nnz > 1 << 40 or input_ref[1] + need > buf.nbytes:
            raise StepError(codes.INVALID_ARGUMENT, f"input buffer {input_ref[0]!r} holds {buf.nbytes} bytes; "
                                                    f"offset {input_ref[1]} + {need} bytes for nnz={nnz} of tensor "
                                                    f"{spec.name!r} do not fit")
        out = self._buffer(session, result_ref[0], "result")
        try:
            part = spec.read(buf.view, input_ref[1], nnz)
        except (SparseGradError, ValueError) as exc:
            raise StepError(codes.INVALID_ARGUMENT, str(exc)) from None
        key = StepKey(session.job, tid, step_no)
        with self._lock:
            if self.draining:
                raise StepError(codes.UNAVAILABLE, "the daemon is draining: no new steps")
            waiting = self._open_by_session.get((session.session_id, tid))
            if waiting is not None and waiting != step_no:
                raise StepError(codes.FAILED_PRECONDITION, f"step {waiting} of tensor {spec.name!r} is still in flight "
                                                           f"for this trainer; submit {step_no} after it")
            step, start = self.table.join(key, session.local_rank, session.session_id, part,
                                          state.local_world_size)
            self._open_by_session[(session.session_id, tid)] = step_no
        self.metrics.in_flight.set(self.table.in_flight())
        if start:  # the last trainer to arrive runs the step in its own handler thread
            self._run(state, step)
        try:
            if not step.done.wait(min(wait_s, self.step_timeout_s)):
                missing = step.missing()
                who = f"local trainers {missing} have not submitted it" if missing else "the nodes are still summing it"
                raise StepError(codes.DEADLINE_EXCEEDED, f"step {step_no} of tensor {spec.name!r} not done in "
                                                         f"{min(wait_s, self.step_timeout_s):.3g} s: {who}")
        finally:
            with self._lock:  # done, or given up by this trainer: its next step may come
                self._open_by_session.pop((session.session_id, tid), None)
        if step.error is not None:
            raise step.error
        outcome: StepOutcome = step.result
        t0 = time.perf_counter()
        need = spec.nbytes(outcome.grad.nnz)
        if result_ref[1] + need > out.nbytes:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"result buffer {result_ref[0]!r} holds {out.nbytes} bytes; "
                                                      f"the result needs {need} from offset {result_ref[1]} "
                                                      f"(submit the step again with a larger one)")
        spec.write(outcome.grad, out.view, result_ref[1])
        self.metrics.sync_seconds.labels(scheme=outcome.scheme, phase="deliver").observe(time.perf_counter() - t0)
        return outcome

    def session_closed(self, session: Session) -> None:
        """A trainer left (or died): steps waiting for it fail now instead of at their deadline."""
        err = StepError(codes.UNAVAILABLE, f"trainer local rank {session.local_rank} (pid {session.pid}) of job "
                                           f"{session.job!r} disconnected before the step could start")
        for step in self.table.abandon(session.job, err):
            self.metrics.errors.labels(code=err.code).inc()
            log.warning("step failed", extra={"event": "step_failed", "job": session.job, "step": step.key.step,
                                              "error": err.message})
        with self._lock:
            for key in [k for k in self._open_by_session if k[0] == session.session_id]:
                del self._open_by_session[key]
        self.metrics.in_flight.set(self.table.in_flight())

    def expire(self) -> None:
        def error_for(step: Step) -> StepError:
            return StepError(codes.DEADLINE_EXCEEDED, f"step {step.key.step} of tensor {step.key.tensor_id}: "
                                                      f"local trainers {step.missing()} never submitted it")
        for step in self.table.expire(self.step_timeout_s, error_for):
            self.metrics.errors.labels(code=codes.DEADLINE_EXCEEDED).inc()
            log.warning("step expired", extra={"event": "step_expired", "job": step.key.job, "step": step.key.step})

    # ------------------------------------------------------------------ node side
    def _run(self, state: TensorState, step: Step) -> None:
        spec, key = state.spec, step.key
        phases: dict[str, float] = {"wait": time.monotonic() - step.opened_at}
        try:
            with state.lock:
                t = time.perf_counter()
                grad = local_sum(spec, [step.parts[r] for r in sorted(step.parts)])
                phases["local_sum"] = time.perf_counter() - t
                sync_id = f"{job_key(key.job)}/{key.tensor_id}/{key.step}"
                if not state.agreed:
                    t = time.perf_counter()
                    self._agree(state, Channel(self.comm, sync_id, self.step_timeout_s))
                    state.agreed = True
                    phases["agree"] = time.perf_counter() - t
                t = time.perf_counter()
                ch = Channel(self.comm, sync_id, self.step_timeout_s)
                result = state.scheme.sync(ch, grad, average=False)
                phases["exchange"] = time.perf_counter() - t
            out = result.grad
            trainers = self.comm.world_size * state.local_world_size
            if spec.average and trainers > 1:
                out = out.with_values((out.values.to(torch.float32) / trainers).to(spec.dtype))
            n = self.comm.world_size
            dense = 2 * (n - 1) * spec.dense_bytes // n
            outcome = StepOutcome(out, result.scheme, result.traffic.bytes_sent, result.traffic.bytes_recv, dense,
                                  phases)
        except Exception as exc:  # every failure reaches every waiting trainer, mapped to a status
            err = self._as_step_error(exc, state, key)
            self.metrics.errors.labels(code=err.code).inc()
            log.warning("step failed", extra={"event": "step_failed", "job": key.job, "tensor": spec.name,
                                              "step": key.step, "code": err.code, "error": err.message})
            self.table.finish(step, error=err)
            self.metrics.in_flight.set(self.table.in_flight())
            return
        self.table.finish(step, result=outcome)  # trainers go on; the bookkeeping comes after
        self.metrics.in_flight.set(self.table.in_flight())
        try:
            self._record(state, step, grad, result, outcome)
        except Exception:  # metrics must never fail a step that succeeded
            log.exception("recording step %s of tensor %r", key.step, spec.name)

    def _as_step_error(self, exc: Exception, state: TensorState, key: StepKey) -> StepError:
        where = f"step {key.step} of tensor {state.spec.name!r}"
        if isinstance(exc, StepError):
            return exc
        if isinstance(exc, CommTimeout):
            return StepError(codes.DEADLINE_EXCEEDED, f"{where}: {exc}")
        if isinstance(exc, CommError):
            return StepError(codes.UNAVAILABLE, f"{where}: peer node lost: {exc}")
        if isinstance(exc, SparseGradError | ValueError):
            return StepError(codes.INVALID_ARGUMENT, f"{where}: {exc}")
        log.exception("internal error in %s", where)
        return StepError(codes.INTERNAL, f"{where}: internal error {type(exc).__name__}: {exc}")

    def _agree(self, state: TensorState, ch: Channel) -> None:
        """Every node sends every other its description of the tensor; any difference fails everywhere."""
        ours = {**state.spec.describe(), "local_world_size": state.local_world_size}
        blob = torch.frombuffer(bytearray(json.dumps(ours, sort_keys=True).encode()), dtype=torch.uint8)
        for j in range(ch.world_size):
            if j != ch.rank:
                ch.send(j, "agree", blob)
        everyone = {ch.rank: ours}
        for j in range(ch.world_size):
            if j != ch.rank:
                raw = ch.recv(j, "agree")
                try:
                    everyone[j] = json.loads(bytes(raw.numpy()))
                except ValueError:
                    raise StepError(codes.INVALID_ARGUMENT, f"node {j} sent an unreadable tensor description") from None
        base = everyone[0]
        for j in sorted(everyone):
            for field_name in sorted(set(base) | set(everyone[j])):
                if everyone[j].get(field_name) != base.get(field_name):
                    raise StepError(codes.INVALID_ARGUMENT,
                                    f"tensor {state.spec.name!r} of job {state.spec.job!r}: node {j} has "
                                    f"{field_name}={everyone[j].get(field_name)!r} but node 0 has "
                                    f"{field_name}={base.get(field_name)!r}")

    def _record(self, state: TensorState, step: Step, grad: SparseGrad, result: Any, outcome: StepOutcome) -> None:
        m, spec = self.metrics, state.spec
        job, tensor = m.tensor_label(spec.job, spec.name)
        for phase, seconds in outcome.phases.items():
            m.sync_seconds.labels(scheme=outcome.scheme, phase=phase).observe(seconds)
        m.sync_seconds.labels(scheme=outcome.scheme, phase="total").observe(sum(outcome.phases.values()))
        m.steps.labels(scheme=outcome.scheme).inc()
        m.dense_bytes.inc(outcome.dense_bytes)
        m.saved_bytes.inc(max(0, outcome.dense_bytes - outcome.bytes_sent))
        m.nnz_in.labels(job, tensor).set(grad.nnz)
        m.nnz_out.labels(job, tensor).set(outcome.grad.nnz)
        m.density.labels(job, tensor).set(outcome.grad.density)
        mean_in = result.mean_input_rows or grad.nnz
        m.densification.labels(job, tensor).set(outcome.grad.nnz / mean_in if mean_in else 1.0)
        m.push_imbalance.labels(job, tensor).set(result.push_load_imbalance)
        m.pull_imbalance.labels(job, tensor).set(result.pull_imbalance)
        previous = state.stats.get("scheme")
        if previous and previous != outcome.scheme:
            m.scheme.labels(job, tensor, previous).set(0)
        m.scheme.labels(job, tensor, outcome.scheme).set(1)
        state.stats.update(scheme=outcome.scheme, last_step=step.key.step, steps=state.stats.get("steps", 0) + 1,
                           last_sync_seconds=sum(outcome.phases.values()), last_nnz_in=grad.nnz,
                           last_nnz_out=outcome.grad.nnz, last_bytes_sent=outcome.bytes_sent,
                           last_push_imbalance=result.push_load_imbalance, last_pull_imbalance=result.pull_imbalance)
        log.info("step done", extra={"event": "step_done", "job": spec.job, "tensor": spec.name,
                                     "step": step.key.step, "scheme": outcome.scheme, "nnz_in": grad.nnz,
                                     "nnz_out": outcome.grad.nnz, "bytes_sent": outcome.bytes_sent,
                                     "seconds": round(sum(outcome.phases.values()), 6)})
