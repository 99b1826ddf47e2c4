"""One rank of the torch-backend tests (test_torch_backend.py): `dist.init_process_group("zen")`
against real daemons, a scenario, and a non-zero exit with the first difference."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import zen
import zen.distributed
from torch import nn
from torch.testing._internal.common_distributed import simple_sparse_reduce_tests


def torch_sparse_suite(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """torch's own sparse reduction cases (from the wheel), through the zen backend; each result
    equals torch's expected sum and gloo's on the same inputs."""
    pg = dist.distributed_c10d._get_default_group()
    cases = 0
    for num_inputs in (1, 2):
        for inputs, expected in simple_sparse_reduce_tests(rank, world, num_inputs=num_inputs):
            ours = [t.clone() for t in inputs]
            theirs = [t.clone() for t in inputs]
            # one tensor through the public function, a list through the group (as torch's own tests do)
            work = dist.all_reduce(ours[0], async_op=True) if num_inputs == 1 else pg.allreduce(ours)
            work.wait()
            result = work.get_future().value()
            gloo.allreduce(theirs).wait()
            for got, returned, want, ref in zip(ours, result, expected, theirs, strict=True):
                assert torch.equal(got.to_dense(), want.to_dense()), (num_inputs, got, want)
                assert torch.equal(returned.to_dense(), want.to_dense()), (num_inputs, returned, want)
                assert torch.equal(got.to_dense(), ref.to_dense()), (num_inputs, got, ref)
            cases += 1
    assert cases == 12, cases
    # AVG, fp16 / bf16 values, int32 indices, uncoalesced input (row 1 twice)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.sparse_coo_tensor(torch.tensor([[1, 1, rank + 2]], dtype=torch.int32),
                                    torch.ones(3, 2, dtype=dtype), (world + 2, 2))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        want = torch.zeros(world + 2, 2)
        want[1] = 2.0
        for r in range(world):
            want[r + 2] += 1 / world
        assert t.is_coalesced() and torch.allclose(t.to_dense().float(), want, atol=1e-2), (dtype, t)
    # float64 is not zen's: it goes through gloo, with the same result
    t = torch.sparse_coo_tensor([[rank]], torch.ones(1, dtype=torch.float64), (world,))
    dist.all_reduce(t)
    assert torch.equal(t.to_dense(), torch.ones(world, dtype=torch.float64)), t
    t = torch.sparse_coo_tensor([[0]], torch.ones(1, dtype=torch.float64), (world,))
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)  # gloo has no AVG: divided once, in place
    work.wait()
    for got in (t, work.result()[0]):
        assert got.to_dense()[0].item() == 1.0, got
    # a hint names the tensor: the same shape under two names, two zen tensors
    for hint in ("a", "b"):
        t = zen.distributed.name(torch.sparse_coo_tensor([[0]], torch.ones(1), (3,)), hint)
        dist.all_reduce(t)
        assert t.to_dense()[0].item() == world
    names = set(zen.distributed._group(None).last_stats())
    assert {"pg0.a.sum", "pg0.b.sum"} <= names, names


def dense_ops(rank: int, world: int) -> None:
    """Every other collective runs on the inner gloo group."""
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((4,), float(sum(range(world))))), x
    y = torch.full((2,), float(rank))
    dist.broadcast(y, src=world - 1)
    assert torch.equal(y, torch.full((2,), float(world - 1))), y
    out = [torch.empty(1) for _ in range(world)]
    dist.all_gather(out, torch.tensor([float(rank)]))
    assert [o.item() for o in out] == list(range(world)), out
    flat = torch.empty(world)
    dist.all_gather_into_tensor(flat, torch.tensor([float(rank)]))
    assert flat.tolist() == list(range(world)), flat
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
    assert a2a.tolist() == [10.0 * r + rank for r in range(world)], a2a
    mine = torch.empty(1)
    dist.reduce_scatter_tensor(mine, torch.arange(world, dtype=torch.float32) + rank)
    assert mine.item() == world * rank + sum(range(world)), mine
    objs: list[object] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], objs
    if world > 1:
        if rank == 0:
            dist.send(torch.tensor([42.0]), dst=1)
        elif rank == 1:
            got = torch.empty(1)
            dist.recv(got, src=0)
            assert got.item() == 42.0
    dist.barrier()


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(300, 8, sparse=True)
        self.emb2 = nn.Embedding(300, 8, sparse=True)  # same shape: one zen name, steps in call order
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # 0.5 *: the two embeddings' sparse gradients must not alias one gradient buffer (DDP divides
        # each in place, twice for an alias: wrong on gloo as well)
        return self.out(self.emb(ids) + 0.5 * self.emb2(ids % 7)).pow(2).mean()


def ddp_matches_gloo(rank: int, world: int, gloo: dist.ProcessGroup, models: tuple[type, ...] = ()) -> None:
    """The same model under DDP on the zen backend and on a plain gloo group: the same parameters."""
    for make in models or (Dense, Sparse):
        torch.manual_seed(0)
        ours, theirs = make(), make()
        theirs.load_state_dict(ours.state_dict())
        a = nn.parallel.DistributedDataParallel(ours)
        b = nn.parallel.DistributedDataParallel(theirs, process_group=gloo)
        opt_a, opt_b = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)
        for step in range(5):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 6, generator=g) if make is Dense else torch.randint(0, 300, (4, 5), generator=g)
            for m, opt in ((a, opt_a), (b, opt_b)):
                opt.zero_grad()
                m(x).backward()
                opt.step()
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (make.__name__, n, (p - q).abs().max())
    names = set(zen.distributed._group(None).last_stats())
    if make is Sparse:
        assert any(".sparse1[" in n for n in names), f"no sparse bucket went through zend: {names}"
    dense_via_zen = any(n.startswith(("pg0.dense[", "pg0.topk")) for n in names)
    assert dense_via_zen == (os.environ.get("ZEN_DENSE_ALLREDUCE", "inner") != "inner"), names


class TwoTables(nn.Module):
    """word2vec-like: two tables of one shape, each row touched by few ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.center = nn.Embedding(200, 8, sparse=True)
        self.context = nn.Embedding(200, 8, sparse=True)
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.center(ids[:, 0]) * self.context(ids[:, 1])).pow(2).mean()


def sparse_adam_matches_gloo(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """DDP on the zen backend and on gloo, SparseAdam for the tables (it moves exactly the rows present
    in a gradient, with momentum): the same losses at every step, 1e-6 relative, and two zen tensors."""
    torch.manual_seed(0)
    ours, theirs = TwoTables(), TwoTables()
    theirs.load_state_dict(ours.state_dict())
    runs = []
    for model, group in ((ours, None), (theirs, gloo)):
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        tables = [model.center.weight, model.context.weight]
        runs.append((ddp, torch.optim.SparseAdam(tables, lr=0.05), torch.optim.Adam(model.out.parameters(), lr=0.05)))
    for step in range(10):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 200, (6, 2), generator=g)
        losses = []
        for ddp, sparse_opt, dense_opt in runs:
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss = ddp(ids)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[1]), (step, losses)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), (n, (p - q).abs().max())
    names = sorted(zen.distributed._group(None).last_stats())
    print("ZEN_TENSORS " + " ".join(names), flush=True)


def out_of_order(rank: int, world: int) -> None:
    """Rank 0 reduces a [5] tensor first, the others a [6] one: every rank gets OutOfOrder naming both."""
    shape = 5 if rank == 0 else 6
    t = torch.sparse_coo_tensor([[0]], torch.ones(1), (shape,))
    work = dist.all_reduce(t, async_op=True)
    started = time.monotonic()
    try:
        work.wait()
    except zen.OutOfOrder as exc:
        assert "[5]" in str(exc) and "[6]" in str(exc), exc
        assert time.monotonic() - started < 10, "the order check took the step timeout"
        print("OUT_OF_ORDER_OK", flush=True)
        os._exit(0)  # the zen step of the other shape is still waiting: the group is unusable
    raise AssertionError("ranks calling in different orders got no error")


def daemon_lost(rank: int, world: int) -> None:
    """After a first step, the test kills node 1's daemon; node 0's next sparse all_reduce fails from
    work.wait() with a typed zen error within the peer timeout."""
    t = torch.sparse_coo_tensor([[rank]], torch.ones(1), (world,))
    dist.all_reduce(t)
    print("FIRST_STEP_DONE", flush=True)
    sys.stdin.readline()  # the test kills node 1's daemon, then writes a line
    if rank != 0:
        os._exit(0)
    started = time.monotonic()
    work = dist.all_reduce(torch.sparse_coo_tensor([[rank]], torch.ones(1), (world,)), async_op=True)
    try:
        work.wait()
    except (zen.StepAborted, zen.DaemonUnavailable) as exc:
        print(f"TYPED_ERROR {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
        os._exit(0)
    raise AssertionError("a step without node 1's daemon succeeded")


def cuda_sparse(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """GPU machines only: CUDA sparse all_reduce through zend (CUDA IPC buffers, no host staging)
    equals the reference; a dense CUDA all_reduce runs on the inner NCCL group (world 1 only: NCCL
    refuses two ranks on one GPU); then zen's time against gloo's host-staged sparse all_reduce."""
    torch.cuda.set_device(0)
    for shape, sparse_dims in (((1000, 16), 1), ((40, 50, 8), 2)):
        dense = torch.zeros(shape)
        g = torch.Generator().manual_seed(rank)
        rows = torch.randint(0, shape[0], (200,), generator=g)
        dense[rows] = torch.randn((200, *shape[1:]), generator=g)
        t = dense.cuda().to_sparse(sparse_dims)
        dist.all_reduce(t)
        assert t.is_cuda, t.device
        want = dense.clone()
        gloo.allreduce([want]).wait()
        assert torch.allclose(t.to_dense().cpu(), want, atol=1e-5), (shape, (t.to_dense().cpu() - want).abs().max())
    if world == 1:
        x = torch.ones(8, device="cuda")
        dist.all_reduce(x)
        assert x.is_cuda and torch.equal(x.cpu(), torch.ones(8))
        assert zen.distributed._group(None)._nccl is not None
    for mb in (1, 16, 64):
        width = 256
        num_rows = mb * 2**20 // (4 * width) * 4  # a quarter of the rows in each rank's gradient
        rows = torch.randperm(num_rows, generator=torch.Generator().manual_seed(rank))[:num_rows // 4]
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), torch.randn(len(rows), width), (num_rows, width)).cuda()
        timings = {}
        for label, group in (("zen", None), ("gloo", gloo)):
            for attempt in range(4):
                t = grad.clone()
                torch.cuda.synchronize()
                started = time.perf_counter()
                dist.all_reduce(t, group=group)
                torch.cuda.synchronize()
                if attempt:  # the first registers buffers / warms up
                    timings.setdefault(label, []).append(time.perf_counter() - started)
        if rank == 0:
            print(f"CUDA_SPARSE {mb} MB of rows: zen {min(timings['zen']) * 1e3:.1f} ms, gloo (host-staged) "
                  f"{min(timings['gloo']) * 1e3:.1f} ms", flush=True)


def main() -> None:
    scenario = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    options = zen.distributed.Options(topk_ratio=1.0)  # top-k of every value: the exact sum, through zend
    dist.init_process_group(os.environ.get("ZEN_TEST_BACKEND", "zen"), rank=rank, world_size=world,
                            pg_options=options)
    assert isinstance(dist.distributed_c10d._get_default_group(), zen.distributed.ZenProcessGroup)
    if scenario in ("daemon_lost", "out_of_order"):
        {"daemon_lost": daemon_lost, "out_of_order": out_of_order}[scenario](rank, world)
    gloo = dist.new_group(backend="gloo")
    if scenario == "sparse_suite":
        torch_sparse_suite(rank, world, gloo)
        dense_ops(rank, world)
    elif scenario == "ddp":
        ddp_matches_gloo(rank, world, gloo)
    elif scenario == "ddp_dense":  # ZEN_DENSE_ALLREDUCE=ring|topk: dense buckets through zend too
        ddp_matches_gloo(rank, world, gloo, (Dense,))
    elif scenario == "sparse_adam":
        sparse_adam_matches_gloo(rank, world, gloo)
    elif scenario == "cuda_sparse":
        cuda_sparse(rank, world, gloo)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.destroy_process_group()
    print("OK", flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown under gloo's threads (examples/common.py: exit_process)


if __name__ == "__main__":
    main()
