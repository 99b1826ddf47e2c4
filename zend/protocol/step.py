"""One step of a tensor, defined once: what a trainer asks, what the daemon answers, how it can fail.

A step travels one of two ways, and both carry exactly these: as a "step" message on the buffer
socket (the doorbell: a tenth of a gRPC call's CPU; `to_wire` / `from_wire`), or as the gRPC Submit
(`to_proto` / `from_proto`). The daemon has one entry for it (`TrainerSteps.step`, `step_async`);
the trainer gets a `StepResult` or a `StepFailed` whichever way it went, and the client turns the
status name into its typed error from one table (zen.errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zend.api.zen.v1 import zen_pb2 as pb
from zend.buffers import wire

MAX_WAIT_S = 86400.0
# the words of NOT_FOUND for a session the daemon does not know (it restarted since the session opened)
SESSION_UNKNOWN = "is not open on this daemon"
# every status a step may end with, and what the trainer should make of it
STATUSES = {
    "INVALID_ARGUMENT": "a bad tensor, buffer or index, named in the message; nobody else is affected",
    "NOT_FOUND": "the session or tensor is not known here (a restarted daemon: open a new session)",
    "FAILED_PRECONDITION": "the step is out of order (already done, or another still in flight)",
    "UNAUTHENTICATED": "another job's token",
    "PERMISSION_DENIED": "another job's token",
    "DEADLINE_EXCEEDED": "the trainer's own deadline passed",
    "ABORTED": "the step failed somewhere (a node or trainer lost): every trainer of it gets this; redo it",
    "UNAVAILABLE": "the daemon is joining, draining or gone",
    "RESOURCE_EXHAUSTED": "a job's quota or the daemon's resources, named in the message",
    "INTERNAL": "a bug in the daemon, which keeps serving",
}


class StepFailed(Exception):
    """A step that did not produce a result, whichever way it was submitted: `code` is its status name
    (one of STATUSES, or UNKNOWN), `message` the daemon's words."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code, self.message = code, message


@dataclass(frozen=True)
class BufferRef:
    """Where in a session's buffers a gradient (or a result) lies."""

    buffer: str
    offset: int = 0


@dataclass(frozen=True)
class StepRequest:
    tensor: int
    step: int
    input: BufferRef
    nnz: int
    result: BufferRef
    timeout_s: float  # how long the trainer waits (the daemon answers just before)

    def to_wire(self) -> dict[str, Any]:
        return {"op": "step", "tensor": self.tensor, "step": self.step, "input": self.input.buffer,
                "input_offset": self.input.offset, "nnz": self.nnz, "result": self.result.buffer,
                "result_offset": self.result.offset, "timeout_s": self.timeout_s}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> StepRequest:
        """From a buffer-socket message; wire.ProtocolError naming the bad field (the connection is dropped)."""
        ints = {name: wire.checked_field(body, name, int) for name in ("tensor", "step", "input_offset", "nnz",
                                                                "result_offset")}
        for name, value in ints.items():
            if not 0 <= value < 1 << 63:
                raise wire.ProtocolError(f"step: field {name!r} = {value} is outside [0, 2^63)")
        timeout = body.get("timeout_s")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= MAX_WAIT_S:
            raise wire.ProtocolError(f"step: field 'timeout_s' must be a number of seconds in (0, {MAX_WAIT_S:g}], "
                                     f"got {timeout!r}")
        source = BufferRef(wire.checked_field(body, "input", str), ints["input_offset"])
        result = BufferRef(wire.checked_field(body, "result", str), ints["result_offset"])
        return cls(ints["tensor"], ints["step"], source, ints["nnz"], result, float(timeout))

    def to_proto(self, session_id: str) -> Any:
        return pb.SubmitRequest(session_id=session_id, tensor_id=self.tensor, step=self.step,
                                input=pb.BufferRef(buffer_id=self.input.buffer, offset=self.input.offset),
                                nnz=self.nnz, result=pb.BufferRef(buffer_id=self.result.buffer,
                                                                  offset=self.result.offset))

    @classmethod
    def from_proto(cls, request: Any, timeout_s: float) -> StepRequest:
        """From a Submit (its deadline, if any, is the call's: `timeout_s`)."""
        return cls(request.tensor_id, request.step, BufferRef(request.input.buffer_id, request.input.offset),
                   request.nnz, BufferRef(request.result.buffer_id, request.result.offset), timeout_s)


@dataclass(frozen=True)
class StepResult:
    """What the daemon reports of a step: the result lies in the trainer's result buffer."""

    step: int
    nnz: int  # rows of the result
    scheme: str  # the scheme that ran ("auto:zen": auto chose zen)
    bytes_sent: int  # by this node, for this tensor's step
    bytes_received: int
    dense_bytes: int  # what a dense ring allreduce would have sent from this node
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase in the daemon
    generation: int = 0  # the membership generation the step ran in (0 from an older daemon)
    node_count: int = 0  # its number of nodes

    def to_wire(self) -> dict[str, Any]:  # field by field: asdict deep-copies every field, 0.3 ms a step
        return {"step": self.step, "nnz": self.nnz, "scheme": self.scheme, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "dense_bytes": self.dense_bytes, "phases": dict(self.phases),
                "generation": self.generation, "node_count": self.node_count}

    @classmethod
    def from_wire(cls, body: dict[str, Any], step: int) -> StepResult:
        return cls(step, int(body["nnz"]), str(body["scheme"]), int(body["bytes_sent"]), int(body["bytes_received"]),
                   int(body["dense_bytes"]), {str(k): float(v) for k, v in dict(body["phases"]).items()},
                   int(body.get("generation", 0)), int(body.get("node_count", 0)))

    def to_proto(self) -> Any:
        return pb.SubmitReply(nnz=self.nnz, scheme=self.scheme, bytes_sent=self.bytes_sent,
                              bytes_received=self.bytes_received, dense_bytes=self.dense_bytes,
                              phases=[pb.PhaseSeconds(phase=k, seconds=v) for k, v in self.phases.items()],
                              generation=self.generation, node_count=self.node_count)

    @classmethod
    def from_proto(cls, reply: Any, step: int) -> StepResult:
        return cls(step, reply.nnz, reply.scheme, reply.bytes_sent, reply.bytes_received, reply.dense_bytes,
                   {p.phase: p.seconds for p in reply.phases}, reply.generation, reply.node_count)
