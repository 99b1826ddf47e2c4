"""The "zen" torch.distributed backend on CUDA tensors: runs only where a GPU is present (skipped in CI).

Sparse all_reduce of CUDA tensors through daemons with GPU buffers (CUDA IPC), the dense ops on the
inner NCCL group, and zen's time against gloo's host-staged sparse all_reduce (printed, for the note).
"""

from __future__ import annotations

import pytest
import torch

from tests.daemon.conftest import fresh_cluster  # noqa: F401  (fixture)
from tests.helpers import ROOT, launch_ranks

pytestmark = [pytest.mark.daemon, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("nodes", [1, 2])
def test_cuda_sparse_all_reduce_on_the_zen_backend_equals_the_reference(fresh_cluster, gpu_figure,  # noqa: F811
                                                                       nodes: int) -> None:
    c = fresh_cluster(nodes, extra=["--log-format", "text"])
    outs = launch_ranks(c, [str(ROOT / "tests/client/backend_worker.py"), "cuda_sparse"], f"cuda{nodes}",
                        timeout_s=300)
    assert all(out.strip().endswith("OK") for out in outs), outs
    for line in outs[0].splitlines():  # CUDA_SPARSE 16 MB of rows: zen 3.1 ms, gloo (host-staged) 9.2 ms
        if line.startswith("CUDA_SPARSE"):
            mb = line.split()[1]
            zen_ms, gloo_ms = (float(part.split()[-2]) for part in line.split(": ", 1)[1].split(", "))
            gpu_figure(f"sparse all_reduce of {mb} MB rows, {nodes} node(s): zen", zen_ms, "ms")
            gpu_figure(f"sparse all_reduce of {mb} MB rows, {nodes} node(s): gloo host-staged", gloo_ms, "ms")
