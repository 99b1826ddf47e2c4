"""Every scheme gives the dense reference sum, on every rank, whatever the input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.helpers import assert_close_to, reference_sum, run_scheme
from zend.core import SCHEMES, SparseGrad
from zend.core.schemes.auto import AutoScheme

ALL = sorted(SCHEMES)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def cluster_inputs(draw, n=None):
    n = draw(st.sampled_from([1, 2, 3, 4, 5, 8])) if n is None else n
    num_rows = draw(st.integers(1, 300))
    row_shape = draw(st.sampled_from([(), (1,), (3,), (8,), (2, 5), (32,)]))
    dtype = draw(st.sampled_from(DTYPES))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    shape = draw(st.sampled_from(["random", "skewed", "dense", "single", "empty_some"]))
    grads = []
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    for rank in range(n):
        if shape == "dense":
            idx = torch.arange(num_rows)
        elif shape == "single":
            idx = torch.tensor([num_rows - 1])
        elif shape == "empty_some" and rank % 2 == 0:
            idx = torch.empty(0, dtype=torch.int64)
        elif shape == "skewed":  # most mass on the first rows, with duplicates
            k = int(torch.randint(0, 3 * num_rows + 1, (1,), generator=gen))
            idx = (torch.rand(k, generator=gen) ** 4 * num_rows).long().clamp_(max=num_rows - 1)
        else:
            k = int(torch.randint(0, 2 * num_rows + 1, (1,), generator=gen))
            idx = torch.randint(0, num_rows, (k,), generator=gen)
        values = torch.randn(len(idx), *row_shape, generator=gen).to(dtype)
        grads.append(SparseGrad(idx.to(index_dtype), values, num_rows, "g"))
    return grads


@pytest.mark.parametrize("scheme", ALL)
@given(grads=cluster_inputs(), average=st.booleans())
def test_every_scheme_equals_the_reference_sum(scheme, grads, average):
    results = run_scheme(scheme, grads, average=average)
    expected = reference_sum(grads, average)
    for r in results:
        assert r.grad.coalesced and r.grad.dtype == grads[0].dtype
        assert r.grad.dense_shape == grads[0].dense_shape
        assert_close_to(r.to_dense(), expected, grads[0].dtype, len(grads))


@pytest.mark.parametrize("scheme", ALL)
@given(grads=cluster_inputs())
def test_deterministic_is_bit_identical_across_ranks_and_runs(scheme, grads):
    first = run_scheme(scheme, grads, deterministic=True)
    again = run_scheme(scheme, grads, deterministic=True)
    reference = first[0].to_dense()
    for r in first + again:
        assert torch.equal(r.to_dense(), reference)


@pytest.mark.parametrize("scheme", ["zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense"])
def test_every_rank_gets_the_same_bits_even_without_deterministic(scheme):
    torch.manual_seed(0)
    grads = [SparseGrad(torch.randint(0, 500, (300,)), torch.randn(300, 16), 500, "g") for _ in range(6)]
    results = run_scheme(scheme, grads)
    assert all(torch.equal(r.to_dense(), results[0].to_dense()) for r in results)


def test_traffic_is_reported_per_phase_and_balances_across_the_cluster():
    torch.manual_seed(1)
    grads = [SparseGrad(torch.randint(0, 1000, (200,)), torch.randn(200, 8), 1000, "g") for _ in range(4)]
    for scheme in ["zen", "hc", "agsparse", "omnireduce", "sparse_ps", "dense"]:
        results = run_scheme(scheme, grads)
        sent = sum(r.traffic.bytes_sent for r in results)
        recv = sum(r.traffic.bytes_recv for r in results)
        assert sent == recv > 0, scheme  # every byte sent is received once
        phases = set().union(*(r.traffic.phases for r in results))
        assert phases, scheme
    zen = run_scheme("zen", grads)[0]
    assert set(zen.traffic.phases) == {"push", "pull"}


def test_dense_ring_moves_the_textbook_volume():
    grads = [SparseGrad(torch.tensor([0]), torch.ones(1, 10), 100, "g") for _ in range(4)]
    r = run_scheme("dense", grads)[0]
    payload = 2 * 3 / 4 * 100 * 10 * 4  # 2 (n-1)/n * elements * bytes
    headers = 2 * 3 * 40
    assert r.traffic.bytes_sent == payload + headers


def test_zen_reports_imbalance_and_cluster_wide_profile():
    torch.manual_seed(2)
    grads = [SparseGrad(torch.randint(0, 5000, (400,)), torch.randn(400, 4), 5000, "g") for _ in range(8)]
    results = run_scheme("zen", grads)
    for r in results:
        assert r.push_imbalance >= 1.0 and r.pull_imbalance >= 1.0
        assert r.mean_input_rows == pytest.approx(sum(g.coalesce().nnz for g in grads) / 8)
    assert len({r.pull_imbalance for r in results}) == 1  # cluster-wide, same everywhere


def _auto_run(grads_per_step, reprofile_every):
    from zend.core import Channel
    from zend.transport.inproc import InProcessCluster

    n = len(grads_per_step[0])
    schemes = [AutoScheme(seed=1, reprofile_every=reprofile_every) for _ in range(n)]
    ran = []
    for step, grads in enumerate(grads_per_step):
        results = InProcessCluster(n).run(
            lambda rank, comm, grads=grads, step=step: schemes[rank].sync(Channel(comm, f"s{step}"), grads[rank]))
        assert len({r.scheme for r in results}) == 1  # every rank made the same choice
        for r, g in zip(results, [reference_sum(grads)] * n, strict=True):
            assert_close_to(r.to_dense(), g, torch.float32, n)
        ran.append(results[0].scheme)
    return ran


def test_auto_profiles_then_picks_and_reprofiles_when_density_drifts():
    torch.manual_seed(3)
    n, rows = 4, 4000
    sparse = [SparseGrad(torch.randint(0, rows, (20,)), torch.randn(20, 8), rows, "g") for _ in range(n)]
    dense = [SparseGrad(torch.arange(rows), torch.randn(rows, 8), rows, "g") for _ in range(n)]
    ran = _auto_run([sparse, sparse, sparse, dense, dense, dense], reprofile_every=3)
    assert ran[0] == "auto:zen"  # first sync profiles
    assert ran[1] in ("auto:zen", "auto:hc") and ran[2] == ran[1]
    assert ran[3] == "auto:zen"  # re-profile sees the dense gradient...
    assert ran[4] == ran[5] == "auto:dense"  # ...and falls back to dense, which is cheaper


def test_unknown_scheme_is_named():
    from zend.core import make_scheme

    with pytest.raises(ValueError, match="unknown scheme 'allreduce'"):
        make_scheme("allreduce")
