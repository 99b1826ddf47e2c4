"""Typed exceptions: one mapping from the daemon's status codes (a step's, by gRPC or on the buffer socket,
or any other call's), nothing else to catch. Every one is a torch.distributed.DistError too, so that a
loop written for torch's backends (`except DistError`) catches zen's."""

from __future__ import annotations

import grpc
from torch.distributed import DistError, DistNetworkError

from zend.protocol.step import StepFailed


class ZenError(DistError):
    """Base of every zen client error; `code` is the daemon's status name."""

    code = "UNKNOWN"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidGradient(ZenError, ValueError):
    """The tensor cannot be synchronised as given (shape, dtype, index, NaN, another node's shape)."""

    code = "INVALID_ARGUMENT"


class NotRegistered(ZenError, LookupError):
    code = "NOT_FOUND"


class OutOfOrder(ZenError):
    """A step that was already synchronised, or one submitted before the previous finished."""

    code = "FAILED_PRECONDITION"


class NotAuthorized(ZenError, PermissionError):
    """The job token is missing or is another job's."""

    code = "UNAUTHENTICATED"


class StepTimeout(ZenError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class StepAborted(ZenError):
    """The step failed somewhere (a node or a trainer lost, a peer slower than the step timeout) and
    every node aborted it: no trainer of the job got a result for it. The message names the lost node
    or trainer and the step. The training loop decides: submit the same step again, from the same
    state, once the job is whole again; or stop."""

    code = "ABORTED"


class DaemonUnavailable(ZenError, DistNetworkError, ConnectionError):
    """No daemon at the address, a peer node lost, the daemon draining or gone mid-step."""

    code = "UNAVAILABLE"


class OutOfResources(ZenError):
    code = "RESOURCE_EXHAUSTED"


_BY_CODE: dict[str, type[ZenError]] = {cls.code: cls for cls in (
    InvalidGradient, NotRegistered, OutOfOrder, NotAuthorized, StepTimeout, StepAborted, DaemonUnavailable,
    OutOfResources)}
_BY_CODE["PERMISSION_DENIED"] = NotAuthorized


def behind(error: BaseException, cause: BaseException | None) -> bool:
    """Whether `error` is the zen error behind `cause`, the RuntimeError DDP raised for it (which
    quotes it); with no cause, any error is taken to be."""
    return cause is None or str(error) in str(cause)


def from_buffer_error(exc: Exception, what: str) -> ZenError:
    """A buffer the daemon refused: OutOfResources when it ran out of something (a limit, descriptors,
    memory; the session lives on, a later request may succeed), InvalidGradient otherwise."""
    code = getattr(exc, "code", None)
    cls = OutOfResources if code == "RESOURCE_EXHAUSTED" else InvalidGradient
    return cls(f"{what}: {exc} [{code or 'INVALID_ARGUMENT'}]")


def from_status(code: str, details: str, address: str) -> ZenError:
    """The typed error of a daemon status (zend.protocol.step.STATUSES), whichever way it came: the one table."""
    cls = _BY_CODE.get(code, ZenError)
    if code == "UNAVAILABLE" and ("connect" in (details or "").lower() or "No such file" in (details or "")):
        details = f"no zend daemon answers at {address}: {details}"
    err = cls(f"{details} [{code}]")
    err.code = code
    return err


def from_rpc_error(exc: grpc.RpcError, address: str) -> ZenError:
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    return from_status(code, exc.details() if hasattr(exc, "details") else str(exc), address)


def from_step_failed(exc: StepFailed, address: str) -> ZenError:
    return from_status(exc.code, exc.message, address)
