"""`step_surviving_faults`: the training loop's answer to a step that zen aborted (redo it once the
cluster is whole), for DDP on the "zen" backend, the DDP comm hook, and `Client.allreduce` alike."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from zen.client import Client
from zen.errors import DaemonUnavailable, StepAborted, ZenError

T = TypeVar("T")
log = logging.getLogger("zen")

# the faults a redo of the same step survives; any other error is the caller's (a bad tensor, a bug)
REDO = (StepAborted, DaemonUnavailable)


def step_surviving_faults(run: Callable[[], T], client: Client | None, hook: Any = None, *, attempts: int = 5,
                          wait_s: float = 120.0) -> T:
    """run() (forward, backward, optimiser step); when zen aborts the step (a node lost or restarted,
    a trainer gone), wait until the cluster is whole and redo it from the same state: the optimiser
    has not stepped, and every trainer of the job redoes the same step, so the run's losses are
    those of a run without the fault. `hook`: the zen.HookState when DDP runs zen's comm hook (else
    the "zen" process group is asked). After `attempts` redos, the last one's error is raised."""
    if client is None:
        return run()
    for attempt in range(attempts):
        try:
            return run()
        except RuntimeError as exc:
            fault = _zen_error_behind(exc, hook)
            if not isinstance(fault, REDO):
                raise
            log.warning("rank %s: %s: %s; waiting for the cluster, then redoing the step (redo %d of %d)",
                        os.environ.get("RANK", "?"), type(fault).__name__, fault, attempt + 1, attempts)
            client.wait_ready(wait_s)
    return run()


def _zen_error_behind(exc: RuntimeError, hook: Any) -> ZenError | None:
    """The zen error behind `exc`: itself, or the typed error behind the RuntimeError that DDP raises
    for any failure of a backend or a hook (torch keeps only its text)."""
    if isinstance(exc, ZenError):
        return exc
    try:
        if hook is not None:
            hook.reraise(exc)
        elif dist.is_initialized() and dist.get_backend() == "zen":
            from zen.distributed import reraise

            reraise(exc)
    except ZenError as typed:
        return typed
    return None
