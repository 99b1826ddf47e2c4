"""zen: sparse gradient synchronisation through the node's zend daemon (ZEN scheme, OSDI 2025).

    import zen
    zen.init()                          # torchrun's variables: init_process_group("zen"), the client
    ddp = DistributedDataParallel(model)

(`zend launch --nodes 2 --trainers 2 -- train.py` runs it with the daemons beside it), or by hand:

    dist.init_process_group("zen")      # the torch.distributed backend: sparse all_reduce via zend
    ddp = DistributedDataParallel(model)

or, for dense buckets top-k'd through the daemon too, the DDP comm hook:

    client = zen.Client()                                  # the sidecar sets the environment
    ddp.register_comm_hook(zen.HookState(client, ddp.module), zen.comm_hook)
"""


from zen import distributed  # registers the "zen" backend
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
from zen.retry import step_surviving_faults
from zen.start import init
from zend.protocol.version import daemon_version as _version

__version__ = _version()  # the distribution's (zen-sync): client and daemon ship together

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
    "__version__",
    "comm_hook",
    "distributed",
    "init",
    "step_surviving_faults",
    "sync_gradients",
]
