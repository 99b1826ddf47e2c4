"""One mapping from the daemon's errors to gRPC statuses, as a decorator on every RPC handler.

A StepError becomes its status with its message; anything unexpected becomes INTERNAL and is
logged, and the daemon keeps serving. Never a pickled exception on the wire. Handlers may be
plain functions (run on the server's handler threads) or coroutines (on its event loop).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import grpc

from zend.daemon import errors as codes
from zend.daemon.errors import StepError

log = logging.getLogger("zend.service")


class CountsErrors(Protocol):
    """A servicer that counts the errors it answers with (DaemonMetrics.count_error)."""

    count_error: Callable[[str], None]


S = TypeVar("S", bound=CountsErrors)
Handler = Callable[[S, Any, grpc.ServicerContext], Any]


def maps_errors(handler: Handler[S]) -> Handler[S]:
    """Wrap an RPC handler: StepError -> its status, anything else -> INTERNAL; both counted."""
    what = handler.__name__
    if inspect.iscoroutinefunction(handler):
        return _maps_errors_async(handler)

    @functools.wraps(handler)
    def wrapped(self: S, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except StepError as exc:
            self.count_error(exc.code)
            context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        except Exception as exc:
            self.count_error(codes.INTERNAL)
            log.exception("internal error in %s", what)
            context.abort(grpc.StatusCode.INTERNAL, f"{what}: internal error {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: abort raises")

    return wrapped


def _maps_errors_async(handler: Handler[S]) -> Handler[S]:
    what = handler.__name__

    @functools.wraps(handler)
    async def wrapped(self: S, request: Any, context: Any) -> Any:
        try:
            return await handler(self, request, context)
        except StepError as exc:
            self.count_error(exc.code)
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        except Exception as exc:
            self.count_error(codes.INTERNAL)
            log.exception("internal error in %s", what)
            await context.abort(grpc.StatusCode.INTERNAL, f"{what}: internal error {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable: abort raises")

    return wrapped
