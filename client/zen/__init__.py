"""zen: sparse gradient synchronisation through the node's zend daemon (ZEN scheme, OSDI 2025).

    import zen
    client = zen.Client()                                  # the sidecar sets the environment
    ddp.register_comm_hook(zen.HookState(client, ddp.module), zen.comm_hook)
"""

from zen.client import Client, StepStats
from zen.ddp import HookState, comm_hook, sync_gradients
from zen.errors import (
    DaemonUnavailable,
    InvalidGradient,
    NotAuthorized,
    NotRegistered,
    OutOfOrder,
    OutOfResources,
    StepAborted,
    StepTimeout,
    ZenError,
)

__all__ = [
    "Client",
    "DaemonUnavailable",
    "HookState",
    "InvalidGradient",
    "NotAuthorized",
    "NotRegistered",
    "OutOfOrder",
    "OutOfResources",
    "StepAborted",
    "StepStats",
    "StepTimeout",
    "ZenError",
    "comm_hook",
    "sync_gradients",
]
