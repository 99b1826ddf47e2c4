"""A training script as a new user writes one for `zend launch`: zen.init(), then sparse all_reduce.

argv: STEPS [fail|sleep|die-once]. Each rank adds rows {rank, 100} with value rank+1 and checks the sum.
die-once: the last rank dies (exit 1) before step 2 of the job's first life, for torchrun to restart it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import zen

client = zen.init()
rank, world = dist.get_rank(), dist.get_world_size()
mode = sys.argv[2] if len(sys.argv) > 2 else ""

def first_death() -> bool:
    """Once in the job: a mark beside the nodes' socket folders (a restart may move the last rank to the other
    node, whose torchrun counts no restart of its own)."""
    mark = os.path.join(os.path.dirname(os.environ["ZEN_SOCKET_DIR"]), "died-once")
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


for step in range(int(sys.argv[1])):
    if mode == "die-once" and step == 2 and rank == world - 1 and first_death():
        os._exit(1)
    rows = torch.tensor([[rank, 100]])
    values = torch.full((2, 4), float(rank + 1))
    grad = torch.sparse_coo_tensor(rows, values, (128, 4), check_invariants=True).coalesce()
    dist.all_reduce(grad)
    got = grad.coalesce().to_dense()
    assert torch.equal(got[100], torch.full((4,), float(sum(r + 1 for r in range(world))))), got[100]
    for r in range(world):
        assert torch.equal(got[r], torch.full((4,), float(r + 1))), (r, got[r])
print(f"rank {rank} of {world}: ok, job {client.job}", flush=True)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "sleep":
    time.sleep(600)
dist.destroy_process_group()
