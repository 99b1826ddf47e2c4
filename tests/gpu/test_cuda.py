"""The same algorithm code on CUDA tensors: runs only where a GPU is present (skipped in CI).

Run on the lent GPU machine with: PYTHONPATH=. python3 -m pytest -q tests/gpu
"""

import pytest
import torch

from tests.core.helpers import assert_close_to, reference_sum, run_scheme
from zend.core import SCHEMES, SparseGrad
from zend.core.codec import decode_units, encode_units
from zend.core.hashing import SeededHash
from zend.core.partition import ZenPartitioner
from zend.simulator.traces import TokenTrace

pytestmark = [pytest.mark.inprocess, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def test_hash_is_identical_on_cpu_and_gpu():
    x = torch.randint(0, 2**31, (1_000_000,))
    for seed, n in [(0, 16), (12345, 7), (2**40 + 3, 128)]:
        assert torch.equal(SeededHash(seed, n)(x), SeededHash(seed, n)(x.to(CUDA)).cpu())


@pytest.mark.parametrize("row_len", [1, 8, 768])
def test_zen_partition_is_identical_on_cpu_and_gpu(row_len):
    trace = TokenTrace.default()
    grad = trace.embedding_grad(0, 0, row_len)
    gpu = SparseGrad(grad.indices.to(CUDA), grad.values.to(CUDA), grad.num_rows, "g", True)
    parts = ZenPartitioner(grad.num_rows, row_len, 16, seed=5)
    for cpu_part, gpu_part in zip(parts.split(grad), parts.split(gpu), strict=True):
        assert torch.equal(cpu_part.keys, gpu_part.keys.cpu())
        assert torch.equal(cpu_part.values, gpu_part.values.cpu())
    back = parts.assemble(parts.split(gpu), gpu)
    assert torch.equal(back.values.cpu(), grad.values)


def test_codec_round_trip_on_gpu():
    keys = torch.randperm(100_000, device=CUDA)[:30_000]
    values = torch.randn(30_000, 4, device=CUDA, dtype=torch.bfloat16)
    msg = encode_units(keys, values, 100_000)
    assert msg.is_cuda
    got_keys, got_values, _ = decode_units(msg, 4, 100_000, torch.bfloat16)
    order = torch.argsort(keys)
    assert torch.equal(got_keys, keys[order]) and torch.equal(got_values, values[order])


def _cuda_grads(n, dtype, rows=3000, width=16):
    gen = torch.Generator().manual_seed(n)
    out = []
    for _ in range(n):
        idx = (torch.rand(2000, generator=gen) ** 3 * rows).long()  # skewed, duplicates
        out.append(SparseGrad(idx.to(CUDA), torch.randn(2000, width, generator=gen).to(dtype).to(CUDA), rows, "g"))
    return out


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_scheme_on_gpu_tensors(scheme, dtype):
    grads = _cuda_grads(4, dtype)
    expected = reference_sum([SparseGrad(g.indices.cpu(), g.values.cpu(), g.num_rows) for g in grads])
    results = run_scheme(scheme, grads)
    for r in results:
        assert r.grad.values.is_cuda
        assert_close_to(r.to_dense().cpu(), expected, dtype, 4)


@pytest.mark.parametrize("scheme", ["zen", "hc", "agsparse", "dense"])
def test_deterministic_is_bit_identical_on_gpu(scheme):
    grads = _cuda_grads(5, torch.float32)
    runs = [run_scheme(scheme, grads, deterministic=True) for _ in range(3)]
    reference = runs[0][0].to_dense()
    for results in runs:
        for r in results:
            assert torch.equal(r.to_dense(), reference)


def test_deterministic_coalesce_on_gpu_repeats_exactly():
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50, (200_000,), generator=gen)
    vals = torch.randn(200_000, 8, generator=gen)
    grad = SparseGrad(idx.to(CUDA), vals.to(CUDA), 50, "g")
    first = grad.coalesce(deterministic=True)
    for _ in range(5):
        assert torch.equal(grad.coalesce(deterministic=True).values, first.values)
    torch.testing.assert_close(first.values.cpu(), SparseGrad(idx, vals, 50).coalesce().values, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_over_tcp_with_gpu_tensors(scheme):
    """tcp:// stages GPU tensors through the host; results come back on the GPU."""
    import threading

    from zend.core import Channel, make_scheme
    from zend.transport import create

    grads = _cuda_grads(3, torch.float32)
    expected = reference_sum([SparseGrad(g.indices.cpu(), g.values.cpu(), g.num_rows) for g in grads])
    ts = [create("tcp://127.0.0.1:0", r, 3, cluster_id="gpu", secret=b"0123456789abcdef!") for r in range(3)]
    peers = {t.rank: t.address for t in ts}
    results: list = [None] * 3
    try:
        def body(t) -> None:  # type: ignore[no-untyped-def]
            t.connect(peers)
            results[t.rank] = make_scheme(scheme, seed=1).sync(Channel(t, "s"), grads[t.rank])

        threads = [threading.Thread(target=body, args=(t,)) for t in ts]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        for r in results:
            assert r is not None and r.grad.values.is_cuda
            assert_close_to(r.to_dense().cpu(), expected, torch.float32, 3)
    finally:
        for t in ts:
            t.close()


def test_hashing_and_partition_of_11m_non_zeros(gpu_figure):
    """ZEN's split on the GPU at the size the paper times (its 6 ms: 214 M elements at 5.2%): 11 M rows."""
    import time

    n, nnz, num_rows = 16, 11_000_000, 214_000_000
    rows = torch.unique(torch.randint(0, num_rows, (nnz,), device=CUDA))
    grad = SparseGrad(rows, torch.ones(rows.numel(), device=CUDA), num_rows, "g", True)
    parts = ZenPartitioner(num_rows, 1, n, seed=3)
    assert sum(p.count for p in parts.split(grad)) == rows.numel()  # lossless; and warm
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        split = parts.split(grad)
        for p in split:
            p.values  # noqa: B018  (the gather, as the push makes it)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    best = sorted(times)[len(times) // 2]
    gpu_figure("hash + partition, 11 M nnz, n = 16 (median of 5)", best * 1e3, "ms")
    gpu_figure("hash + partition rate", rows.numel() / best / 1e6, "M idx/s")
