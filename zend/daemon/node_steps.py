"""The node's part of one step: its trainers' parts summed, checked, synchronised and averaged.

Written against a Communicator and plain values (a TensorState, the parts, a StepKey), with no
gRPC and no buffers, so it runs the same over the daemons' data plane and over an
InProcessCluster in the tests. Every failure comes out as one StepError, which the caller
hands to every trainer waiting for the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zend.core import costmodel
from zend.core.comm import Channel, CommError, CommTimeout, Communicator
from zend.core.schemes import SyncResult
from zend.core.sparse import SparseGrad, SparseGradError
from zend.daemon import errors as codes
from zend.daemon.agreement import agree
from zend.daemon.errors import StepError
from zend.daemon.jobs import TensorState, job_key
from zend.daemon.steps import StepKey
from zend.protocol.layout import TensorSpec

log = logging.getLogger("zend.node")


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
    phases: dict[str, float] = field(default_factory=dict)  # seconds: wait, local_sum, agree, exchange

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


def local_sum(spec: TensorSpec, grads: Sequence[SparseGrad]) -> SparseGrad:
    """The node's gradient: the sum of its trainers' parts (float32 accumulation, one rounding)."""
    if len(grads) == 1:
        return grads[0].coalesce()
    if spec.layout == "dense":
        total = grads[0].values.to(torch.float32).clone()
        for g in grads[1:]:
            total += g.values
        return SparseGrad(grads[0].indices, total.to(spec.dtype), spec.num_rows, spec.name, True)
    indices = torch.cat([g.indices.to(torch.int64) for g in grads])
    values = torch.cat([g.values for g in grads])
    return SparseGrad(indices, values, spec.num_rows, spec.name).coalesce()


class NodeSteps:
    """Runs the steps of this node's tensors over the data plane `comm` (one node = one rank)."""

    def __init__(self, comm: Communicator, timeout_s: float):
        self.comm = comm
        self.timeout_s = timeout_s

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def run(self, state: TensorState, key: StepKey, parts: Sequence[SparseGrad], waited_s: float = 0.0
            ) -> StepOutcome:
        """The step's outcome from the local parts (in local-rank order); StepError on any failure."""
        try:
            return self._run(state, key, parts, waited_s)
        except Exception as exc:
            raise as_step_error(exc, f"step {key.step} of tensor {state.spec.name!r}") from None

    def _run(self, state: TensorState, key: StepKey, parts: Sequence[SparseGrad], waited_s: float) -> StepOutcome:
        spec = state.spec
        phases: dict[str, float] = {"wait": waited_s}
        sync_id = f"{job_key(key.job)}/{key.tensor_id}/{key.step}"  # tags of this step only
        with state.lock:  # one step of a tensor at a time, in step order
            t = time.perf_counter()
            grad = local_sum(spec, parts)
            phases["local_sum"] = time.perf_counter() - t
            if not state.agreed:
                t = time.perf_counter()
                agree(Channel(self.comm, sync_id, self.timeout_s), spec, state.local_world_size)
                state.agreed = True
                phases["agree"] = time.perf_counter() - t
            t = time.perf_counter()
            result = state.scheme.sync(Channel(self.comm, sync_id, self.timeout_s), grad, average=False)
            phases["exchange"] = time.perf_counter() - t
        return self._outcome(state, grad, result, phases)

    def _outcome(self, state: TensorState, grad: SparseGrad, result: SyncResult, phases: dict[str, float]
                 ) -> StepOutcome:
        spec, out = state.spec, result.grad
        trainers = self.world_size * state.local_world_size
        if spec.average and trainers > 1:  # the scheme summed; the mean is over every trainer of the job
            out = out.with_values((out.values.to(torch.float32) / trainers).to(spec.dtype))
        return StepOutcome(out, result.scheme, result.traffic.bytes_sent, result.traffic.bytes_recv,
                           costmodel.dense_ring_bytes(self.world_size, spec.dense_bytes), grad.nnz,
                           result.mean_input_rows, result.push_load_imbalance, result.pull_imbalance, phases)


def as_step_error(exc: Exception, where: str) -> StepError:
    """The status every trainer of a failed step gets: a lost peer, a timeout, bad data, or a bug."""
    if isinstance(exc, StepError):
        return exc
    if isinstance(exc, CommTimeout):
        return StepError(codes.DEADLINE_EXCEEDED, f"{where}: {exc}")
    if isinstance(exc, CommError):
        return StepError(codes.UNAVAILABLE, f"{where}: peer node lost: {exc}")
    if isinstance(exc, SparseGradError | ValueError):
        return StepError(codes.INVALID_ARGUMENT, f"{where}: {exc}")
    log.error("internal error in %s", where, exc_info=exc)
    return StepError(codes.INTERNAL, f"{where}: internal error {type(exc).__name__}: {exc}")
