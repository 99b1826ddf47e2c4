"""One trainer of the checkpoint tests (run by tests.helpers.launch_ranks, torchrun's variables set).

    checkpoint_rank.py save STEPS DTYPE   train STEPS steps, checkpoint every 10 through zen; print the state's digest
    checkpoint_rank.py save-async ...     the same with DCP's async_save (Checkpointer(asynchronous=True))
    checkpoint_rank.py load DTYPE         a fresh model: load the newest complete step; print the step and the digest

The state: a model and its Adam state (replicated: the same on every rank) and a DTensor sharded over the
ranks (each rank's shard its own), in DTYPE (float32 or bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
import zen.checkpoint
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh


def build(seed: int, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(500, 16), torch.nn.Linear(16, 8)).to(dtype)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), torch.randn(64, 8).to(dtype)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 + step)  # the same batch on every rank: the replicated state stays identical
    loss = model(torch.randint(0, 500, (32,))).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, sharded: torch.Tensor, mesh: object) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": opt_sd,
            "sharded": distribute_tensor(sharded, mesh, [Shard(0)])}  # type: ignore[arg-type]


def digest(state: dict) -> str:
    h = hashlib.sha256()

    def walk(x: object, path: str) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif isinstance(x, torch.Tensor):
            t = x.to_local() if hasattr(x, "to_local") else x
            h.update(path.encode() + str(t.dtype).encode() + t.detach().contiguous().view(-1).view(torch.uint8)
                     .numpy().tobytes())
        else:
            h.update(f"{path}={x!r}".encode())

    walk(state, "")
    return h.hexdigest()


def main() -> None:
    mode = sys.argv[1]
    dtype = getattr(torch, sys.argv[-1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ckpt = zen.checkpoint.Checkpointer(every=10, asynchronous=mode == "save-async")
    if mode.startswith("save"):
        model, opt, sharded = build(0, dtype)
        sharded = sharded + dist.get_rank()  # each rank's shard differs
        for step in range(1, int(sys.argv[2]) + 1):
            train(model, opt, step)
            state = state_of(model, opt, sharded * step, mesh)
            ckpt.maybe_save(state, step)
        ckpt.wait()
        print(json.dumps({"digest": digest(state), "rank": dist.get_rank()}))
    else:
        model, opt, sharded = build(7, dtype)  # different values everywhere: the load must overwrite them all
        train(model, opt, 0)  # Adam's state exists, to be overwritten
        state = state_of(model, opt, torch.zeros_like(sharded), mesh)
        step = ckpt.load_latest(state)
        print(json.dumps({"step": step, "digest": digest(state), "rank": dist.get_rank()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
