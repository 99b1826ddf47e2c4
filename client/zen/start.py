"""`zen.init()`: the script side of `zend launch` (or of any torchrun beside a zend sidecar)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from zen.client import Client


def init(timeout: timedelta | None = None) -> Client:
    """The "zen" process group from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), and the
    client under it, opened on the sidecar's variables (ZEN_SOCKET_DIR, ZEN_JOB, ZEN_JOB_TOKEN; `zend
    launch` sets them). Waits up to `timeout` (torch's default for a process group) for a daemon that
    is still starting or joining its cluster. Calling it again returns the same client.

        client = zen.init()
        model = DistributedDataParallel(model)     # sparse gradients through zend
    """
    from zen.distributed import client_of

    if not dist.is_initialized():
        if timeout is None:
            dist.init_process_group("zen")
        else:
            dist.init_process_group("zen", timeout=timeout)
    return client_of()
