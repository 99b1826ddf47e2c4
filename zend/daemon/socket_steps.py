"""The step doorbell on the buffer socket: a thin adapter from a "step" message to the daemon's one entry.

A no-op gRPC call costs 0.5-0.9 ms of CPU on each side (Python's server is a thread pool behind a
poller); a step's doorbell on the session's own unix socket costs a tenth of that. The session
was authenticated when it was claimed on that socket (hello with its job token; the same process
and token for every extra connection), so a step needs no token. The request, the result and the
statuses are zend.protocol.step's, as for the gRPC Submit; both run `TrainerSteps.step`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from zend.buffers import wire
from zend.buffers.buffer_server import SessionInfo
from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.daemon.jobs import JobRegistry
from zend.daemon.trainer_steps import TrainerSteps
from zend.protocol.step import StepRequest

log = logging.getLogger("zend.service")
OP = "step"


class SocketSteps:
    """The buffer server's handler of op "step": runs a trainer's step request and answers it."""

    def __init__(self, registry: JobRegistry, trainer_steps: TrainerSteps, count_error: Callable[[str], None]):
        self.registry, self.trainer_steps, self.count_error = registry, trainer_steps, count_error

    def __call__(self, info: SessionInfo, body: dict[str, Any]) -> dict[str, Any]:
        request = StepRequest.from_wire(body)  # wire.ProtocolError: the connection is dropped
        try:
            result = self.trainer_steps.step(self.registry.session(info.session_id), request)
        except StepError as exc:
            self.count_error(exc.code)
            return wire.reply_error(exc.message, exc.code)
        except Exception as exc:  # a bug: the trainer gets INTERNAL, the daemon keeps serving
            self.count_error(codes.INTERNAL)
            log.exception("internal error in a step on the buffer socket")
            return wire.reply_error(f"step: internal error {type(exc).__name__}: {exc}", codes.INTERNAL)
        return wire.reply_ok(**result.to_wire())
