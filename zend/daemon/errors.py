"""The one error type of the daemon's step path, with the gRPC status it maps to."""

from __future__ import annotations

# status names as in grpc.StatusCode, kept as strings so pure modules need no gRPC import
INVALID_ARGUMENT = "INVALID_ARGUMENT"
NOT_FOUND = "NOT_FOUND"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
ABORTED = "ABORTED"  # a step failed somewhere (a node or trainer lost): every node aborts it; retry it
UNAVAILABLE = "UNAVAILABLE"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
PERMISSION_DENIED = "PERMISSION_DENIED"
UNAUTHENTICATED = "UNAUTHENTICATED"
INTERNAL = "INTERNAL"


class StepError(Exception):
    """A request or a step that failed; `code` is the gRPC status every affected trainer gets."""

    def __init__(self, code: str, message: str, job_step: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.job_step = job_step  # where the job is, when this node learned it is behind (a restart)
