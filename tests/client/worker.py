"""One rank of the client tests (launched by test_client.py with torchrun-style and ZEN_* variables).

Runs a scenario with the zen hook or helper next to plain torch.distributed on the same inputs,
and exits non-zero with the first difference.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import zen
from torch import nn


class Mixed(nn.Module):
    """A sparse embedding, a second embedding used only on some steps, and dense layers.

    Under DDP the rarely used embedding is dense: torch's DDP reducer itself refuses an unused
    sparse parameter ("Expected sparse gradient to be defined"), hook or not.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, rare_sparse: bool = True):
        super().__init__()
        self.words = nn.Embedding(500, 8, sparse=True, dtype=dtype)
        self.rare = nn.Embedding(100, 8, sparse=rare_sparse, dtype=dtype)
        self.proj = nn.Linear(8, 4, dtype=dtype)

    def forward(self, ids: torch.Tensor, use_rare: bool) -> torch.Tensor:
        x = self.words(ids)
        if use_rare:
            x = x + self.rare(ids % 100)
        return self.proj(x).float().sum(dim=-1).pow(2).mean()


def dense_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).float().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 500, (4, 6), generator=torch.Generator().manual_seed(100 * step + rank))


def ddp_hook_matches_plain_ddp(client: zen.Client, rank: int, dense: str, fuse: bool) -> None:
    torch.manual_seed(0)
    ours, theirs = Mixed(rare_sparse=False), Mixed(rare_sparse=False)
    theirs.load_state_dict(ours.state_dict())
    a = nn.parallel.DistributedDataParallel(ours, find_unused_parameters=True)
    b = nn.parallel.DistributedDataParallel(theirs, find_unused_parameters=True)
    a.register_comm_hook(zen.HookState(client, ours, dense=dense, topk_ratio=1.0, prefix=f"ddp-{dense}-{fuse}",
                                       fuse=fuse), zen.comm_hook)
    for step in range(4):
        use_rare = step % 2 == 1
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            m(batch(rank, step), use_rare).backward()
        ga, gb = dense_grads(ours), dense_grads(theirs)
        assert ga.keys() == gb.keys(), (step, ga.keys(), gb.keys())
        for name in gb:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


class Tables(nn.Module):
    """Three sparse tables, two of one width, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(500, 8, sparse=True)
        self.b = nn.Embedding(300, 8, sparse=True)
        self.c = nn.Embedding(200, 4, sparse=True)
        self.head = nn.Linear(20, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.a(ids), self.b(ids % 300), self.c(ids % 200)], dim=-1)
        return self.head(x).pow(2).mean()


def ddp_hook_fuses_each_pass_into_one_step_per_width(client: zen.Client, rank: int) -> None:
    """The hook's fused steps: plain DDP's gradients, with the daemon running one step per row width
    per backward pass (a and b share theirs), not one per table."""
    torch.manual_seed(1)
    ours, theirs = Tables(), Tables()
    theirs.load_state_dict(ours.state_dict())
    a, b = nn.parallel.DistributedDataParallel(ours), nn.parallel.DistributedDataParallel(theirs)
    a.register_comm_hook(zen.HookState(client, ours, prefix="fused"), zen.comm_hook)
    for step in range(3):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            m(batch(rank, step)).backward()
        ga, gb = dense_grads(ours), dense_grads(theirs)
        assert ga.keys() == gb.keys(), (step, ga.keys(), gb.keys())
        for name in gb:
            torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
        width8, width4 = client.last_stats("fused.a.weight"), client.last_stats("fused.c.weight")
        assert width8 is not None and width4 is not None, step
        assert client.last_stats("fused.b.weight") is width8, f"step {step}: a and b went in different steps"
        assert width4 is not width8, f"step {step}: tables of widths 8 and 4 in one step"
        assert width8.step == width4.step == step, (step, width8.step, width4.step)  # one step per pass


def helper_matches_reference(client: zen.Client, rank: int, dtype: torch.dtype) -> None:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Mixed(dtype)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        use_rare = rank == 0 and step != 1  # rank 1 never uses `rare`: its gradient is None there
        model(batch(rank, step), use_rare).backward()
        local = dense_grads(model)
        reference = {}
        for name, p in model.named_parameters():
            g = local.get(name, torch.zeros(p.shape))
            dist.all_reduce(g)
            reference[name] = g / world
        zen.sync_gradients(model, client, prefix=f"helper.{dtype}.")
        got = dense_grads(model)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for name, ref in reference.items():
            if name.startswith("rare") and step == 1:
                continue  # nobody used it: nothing to compare, but the step still went through
            torch.testing.assert_close(got[name], ref, rtol=tol, atol=tol, msg=f"{dtype} step {step} {name}")


def empty_and_pair_gradients(client: zen.Client, rank: int) -> None:
    empty = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64), torch.empty(0, 3), (10, 3))
    mine = empty if rank == 0 else torch.sparse_coo_tensor(torch.tensor([[2, 7]]), torch.ones(2, 3), (10, 3))
    out = client.allreduce(mine, name="maybe-empty")
    assert out.is_sparse and out._nnz() == 2 and torch.equal(out.to_dense()[2], torch.ones(3)), out
    both_empty = client.allreduce(empty, name="empty")
    assert both_empty._nnz() == 0
    idx, vals = client.allreduce((torch.tensor([rank, 5]), torch.ones(2, 2)), name="pair", num_rows=8)
    assert idx.tolist() == [0, 1, 5] and vals[:, 0].tolist() == [1.0, 1.0, 2.0], (idx, vals)
    dense = client.allreduce(torch.full((3, 4), float(rank + 1)), name="dense", average=True)
    assert torch.allclose(dense, torch.full((3, 4), 1.5)), dense
    fut = client.allreduce_async(torch.ones(6), name="async")
    assert torch.equal(fut.wait(), torch.full((6,), 2.0))


def main() -> int:
    scenario = sys.argv[1]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    with zen.Client() as client:
        if scenario == "ddp":
            for fuse in (True, False):
                ddp_hook_matches_plain_ddp(client, rank, "torch", fuse)
                ddp_hook_matches_plain_ddp(client, rank, "topk", fuse)  # ratio 1.0: every value, through the daemon
            ddp_hook_fuses_each_pass_into_one_step_per_width(client, rank)
        elif scenario == "helper":
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                helper_matches_reference(client, rank, dtype)
            empty_and_pair_gradients(client, rank)
    dist.destroy_process_group()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
