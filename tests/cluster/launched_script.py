"""A training script as a new user writes one for `zend launch`: zen.init(), then sparse all_reduce.

argv: STEPS [fail|sleep]. Each rank adds rows {rank, 100} with value rank+1 and checks the sum.
"""

import sys
import time

import torch
import torch.distributed as dist
import zen

client = zen.init()
rank, world = dist.get_rank(), dist.get_world_size()
for _ in range(int(sys.argv[1])):
    rows = torch.tensor([[rank, 100]])
    values = torch.full((2, 4), float(rank + 1))
    grad = torch.sparse_coo_tensor(rows, values, (128, 4), check_invariants=True).coalesce()
    dist.all_reduce(grad)
    got = grad.coalesce().to_dense()
    assert torch.equal(got[100], torch.full((4,), float(sum(r + 1 for r in range(world))))), got[100]
    for r in range(world):
        assert torch.equal(got[r], torch.full((4,), float(r + 1))), (r, got[r])
mode = sys.argv[2] if len(sys.argv) > 2 else ""
print(f"rank {rank} of {world}: ok, job {client.job}", flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "sleep":
    time.sleep(600)
dist.destroy_process_group()
