"""Steps submitted on the buffer socket: the gRPC Submit without gRPC, for the hot path.

A no-op gRPC call costs 0.5-0.9 ms of CPU on each side (Python's server is a thread pool behind a
poller); a step's doorbell on the session's own unix socket costs a tenth of that. The session
was authenticated when it was claimed on that socket (hello with its job token; the same process
and token for every extra connection), so a step needs no token. Everything else is the same as
Submit: the same `TrainerSteps.submit`, the same errors (as status code names in the reply), the
same figures.
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

log = logging.getLogger("zend.service")


class SocketSteps:
    """The buffer server's `on_step`: runs a trainer's step request and answers it."""

    def __init__(self, registry: JobRegistry, trainer_steps: TrainerSteps, count_error: Callable[[str], None]):
        self.registry, self.trainer_steps, self.count_error = registry, trainer_steps, count_error

    def __call__(self, info: SessionInfo, request: wire.Step) -> dict[str, Any]:
        try:
            session = self.registry.session(info.session_id)
            out = self.trainer_steps.submit(session, request.tensor, request.step,
                                            (request.input, request.input_offset), request.nnz,
                                            (request.result, request.result_offset),
                                            max(0.0, request.timeout_s - 0.05))  # answer before the deadline
        except StepError as exc:
            self.count_error(exc.code)
            return wire.reply_error(exc.message, exc.code)
        except Exception as exc:  # a bug: the trainer gets INTERNAL, the daemon keeps serving
            self.count_error(codes.INTERNAL)
            log.exception("internal error in a step on the buffer socket")
            return wire.reply_error(f"step: internal error {type(exc).__name__}: {exc}", codes.INTERNAL)
        return wire.reply_ok(nnz=out.grad.nnz, scheme=out.scheme, bytes_sent=out.bytes_sent,
                             bytes_received=out.bytes_received, dense_bytes=out.dense_bytes, phases=out.phases,
                             generation=out.generation, node_count=out.nodes)
