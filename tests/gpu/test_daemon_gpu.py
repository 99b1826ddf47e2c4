"""zend daemons with GPU buffers: trainers hand gradients over by CUDA IPC, sums come back in GPU memory.

Runs only where a GPU is present (skipped in CI). On the lent GPU machine:
PYTHONPATH=. python3 -m pytest -q tests/gpu
"""

from __future__ import annotations

import pytest
import torch

from tests.daemon.conftest import fresh_cluster  # noqa: F401  (fixture)
from tests.helpers import random_grad, run_all
from zend.core.sparse import SparseGrad
from zend.protocol.session import TrainerSession

pytestmark = [pytest.mark.daemon, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dense", [False, True])
def test_two_nodes_sum_gpu_gradients_through_cuda_ipc_buffers(fresh_cluster, dense):  # noqa: F811
    c = fresh_cluster(2, extra=["--log-format", "text"])
    rows, dim = 2000, 32

    def trainer(node: int, local: int) -> torch.Tensor:
        with TrainerSession(c.socket_dir(node), "gpu", c.token("gpu"), local, 2) as link:
            h = link.register("emb", (rows, dim), dense=dense, device="cuda:0")
            assert h.result.device.startswith("cuda")
            g = random_grad(rows, dim, 10 * node + local)
            if dense:
                g = SparseGrad(torch.arange(rows), g.to_dense(), rows, coalesced=True)
            g = SparseGrad(g.indices.cuda(), g.values.cuda(), rows, coalesced=g.coalesced)
            out = link.allreduce(h, g, 0)
            assert out.values.is_cuda
            return out.to_dense().cpu()

    results = run_all([lambda n=n, r=r: trainer(n, r) for n in range(2) for r in range(2)])
    ref = sum(random_grad(rows, dim, 10 * n + r).to_dense() for n in range(2) for r in range(2))
    for got in results:
        assert not isinstance(got, BaseException), got
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
