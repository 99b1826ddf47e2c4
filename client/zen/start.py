"""`zen.init()`: the script side of `zend launch` (or of any torchrun beside a zend sidecar)."""

from __future__ import annotations

import os
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
        store = store_of_this_life()  # under torchrun; else None, and torch's env:// finds its own
        rank = int(os.environ["RANK"]) if store is not None else -1
        world = int(os.environ["WORLD_SIZE"]) if store is not None else -1
        if timeout is None:
            dist.init_process_group("zen", store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group("zen", timeout=timeout, store=store, rank=rank, world_size=world)
    return client_of()


def store_of_this_life(rank: int | None = None) -> dist.Store | None:
    """Under torchrun, its store with a prefix of its own for this life of the job (None elsewhere: torch's
    own then), for `init_process_group(store=...)`; `init()` uses it. torchrun keeps one store across the
    restarts of --max-restarts, and the process groups of a new life read the dead one's addresses from it:
    on torch 2.13 every restart of a job failed in gloo's connectFullMesh ("Connection refused"), zen or not.
    Lives are counted per rank, which every life of the job starts once; torchrun's restart count is not
    shared (a node restarted for another node's failure does not count it), so it cannot name the life."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    rank = int(os.environ["RANK"]) if rank is None else rank
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=5))
    life = store.add(f"zen/lives/{rank}", 1)
    return dist.PrefixStore(f"zen/life{life}/", store)
