"""Every scheme gives the dense reference sum, on every rank, whatever the input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.core.helpers import assert_close_to, reference_sum, run_scheme
from zend.core import SCHEMES, SparseGrad
from zend.core.schemes.auto import AutoScheme

pytestmark = pytest.mark.inprocess

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
    values = r.traffic.phases["reduce_scatter"].bytes_sent + r.traffic.phases["allgather"].bytes_sent
    assert values == payload  # raw pieces: no header, both ends know the sizes
    assert r.traffic.phases["reduce_scatter"].messages_sent == 3
    # beside it, the rows sent as a bitmap (13 bytes for 100 rows) around the same ring: chunks 4, 3, 3, 3
    assert r.traffic.phases["rows"].bytes_sent == 4 + 3 + 3 + 3 + 3 + 4  # rank 0: chunks 0, 3, 2; then 1, 0, 3
    assert r.traffic.phases["rows"].messages_sent == 6


def test_zen_reports_imbalance_and_cluster_wide_profile():
    torch.manual_seed(2)
    grads = [SparseGrad(torch.randint(0, 5000, (400,)), torch.randn(400, 4), 5000, "g") for _ in range(8)]
    results = run_scheme("zen", grads)
    for r in results:
        assert r.push_imbalance >= 1.0 and r.pull_imbalance >= 1.0
        assert r.mean_input_rows == pytest.approx(sum(g.coalesce().nnz for g in grads) / 8)
    assert len({r.pull_imbalance for r in results}) == 1  # cluster-wide, same everywhere


class TimedAuto(AutoScheme):
    """auto with a fake clock: each scheme takes the time the test says, plus a per-rank skew."""

    def __init__(self, times, skew=0.0, **options):
        super().__init__(seed=1, **options)
        self.times, self.skew = times, skew

    def timed(self, name, run):
        return run(), self.times[name] + self.skew


def _auto_run(grads_per_step, schemes):
    from zend.core import Channel
    from zend.transport.inproc import InProcessCluster

    n = len(grads_per_step[0])
    ran = []
    for step, grads in enumerate(grads_per_step):
        results = InProcessCluster(n).run(
            lambda rank, comm, grads=grads, step=step: schemes[rank].sync(Channel(comm, f"s{step}"), grads[rank]))
        assert len({r.scheme for r in results}) == 1  # every rank made the same choice
        for r, g in zip(results, [reference_sum(grads)] * n, strict=True):
            assert_close_to(r.to_dense(), g, torch.float32, n)
        ran.append(results[0].scheme.removeprefix("auto:"))
    return ran


def _sparse_and_dense(n=4, rows=4000):
    torch.manual_seed(3)
    sparse = [SparseGrad(torch.randint(0, rows, (20,)), torch.randn(20, 8), rows, "g") for _ in range(n)]
    dense = [SparseGrad(torch.arange(rows), torch.randn(rows, 8), rows, "g") for _ in range(n)]
    return sparse, dense


def test_auto_times_the_candidates_then_keeps_the_fastest_on_every_rank():
    sparse, _ = _sparse_and_dense()
    times = {"zen": 3.0, "hc": 2.0, "agsparse": 1.0, "sparse_ps": 4.0, "dense": 0.5}
    # ranks disagree on the times (rank 3 is slow): the max over ranks decides, the same everywhere
    schemes = [TimedAuto(times, skew=5.0 * (rank == 3), reprofile_every=100, trials=1) for rank in range(4)]
    ran = _auto_run([sparse] * 7, schemes)
    assert ran[0] == "zen"  # the profile
    assert "dense" not in ran  # pruned: far more bytes than the sparse schemes on a sparse tensor
    assert sorted(ran[1:4]) == ["agsparse", "hc", "sparse_ps"]  # one trial each
    assert ran[4:] == ["agsparse"] * 3  # the fastest measured
    assert all(s.agreed == schemes[0].agreed for s in schemes)
    assert schemes[0].agreed["agsparse"] == 6.0  # rank 3's 1.0 + 5.0


def test_auto_reprofiles_and_follows_the_density():
    sparse, dense = _sparse_and_dense()
    times = {"zen": 3.0, "hc": 2.0, "agsparse": 1.0, "sparse_ps": 4.0, "dense": 0.5}
    schemes = [TimedAuto(times, reprofile_every=5, trials=1) for _ in range(4)]
    ran = _auto_run([sparse] * 5 + [dense] * 7, schemes)
    assert ran[4] == "agsparse"
    assert ran[5] == "zen"  # re-profile sees the dense gradient: dense is a candidate now
    assert ran[6:9] == ["hc", "agsparse", "dense"]  # sparse_ps was more than 2x the best last time
    assert ran[9] == "dense"
    assert ran[10:] == ["zen", "agsparse"]  # the next profile tries only contenders within 2x of dense


def test_auto_with_deterministic_picks_by_bytes_and_never_times():
    sparse, dense = _sparse_and_dense()

    class NoClock(TimedAuto):
        def timed(self, name, run):
            assert not self.plan, "a trial ran under deterministic"
            return run(), 0.0

    schemes = [NoClock({}, reprofile_every=3) for _ in range(4)]
    from zend.core import Channel
    from zend.transport.inproc import InProcessCluster

    ran = []
    for step, grads in enumerate([sparse] * 3 + [dense] * 3):
        results = InProcessCluster(4).run(lambda rank, comm, grads=grads, step=step: schemes[rank].sync(
            Channel(comm, f"s{step}"), grads[rank], deterministic=True))
        ran.append(results[0].scheme)
    assert ran[0] == "auto:zen" and ran[1] == ran[2] and ran[1] in ("auto:zen", "auto:hc")
    assert ran[3] == "auto:zen" and ran[4] == ran[5] == "auto:dense"


def test_unknown_scheme_is_named():
    from zend.core import make_scheme

    with pytest.raises(ValueError, match="unknown scheme 'allreduce'"):
        make_scheme("allreduce")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [False, True])
def test_dense_ring_in_many_pieces_is_the_same_sum(monkeypatch, dtype, average):
    """Pipelined pieces (here 64 bytes, so chunks of uneven piece counts' sizes) change no bit."""
    import zend.core.schemes.dense as dense_scheme

    torch.manual_seed(3)
    grads = [SparseGrad(torch.randint(0, 301, (50,)), torch.randn(50, 3).to(dtype), 301, "g") for _ in range(5)]
    whole = run_scheme("dense", grads, average=average)
    monkeypatch.setattr(dense_scheme, "PIECE_BYTES", 64)
    pieces = run_scheme("dense", grads, average=average)
    assert pieces[0].traffic.phases["reduce_scatter"].messages_sent > 4 * whole[0].traffic.phases[
        "reduce_scatter"].messages_sent
    for a, b in zip(whole, pieces, strict=True):
        assert torch.equal(a.to_dense(), b.to_dense())
    assert_close_to(pieces[0].to_dense(), reference_sum(grads, average), dtype, len(grads))


class SequencedAuto(AutoScheme):
    """auto whose clock gives each scheme's times in turn (the last one again once they run out)."""

    def __init__(self, times, **options):
        super().__init__(seed=1, **options)
        self.times = {name: list(seq) for name, seq in times.items()}

    def checkpoint(self):
        saved = super().checkpoint()
        saved["times"] = {k: list(v) for k, v in self.times.items()}
        return saved

    def timed(self, name, run):
        seq = self.times[name]
        return run(), seq.pop(0) if len(seq) > 1 else seq[0]


def test_auto_goes_by_each_candidates_median_not_its_luckiest_trial():
    """A scheme that was fast once among slow trials (hc: 1, 9, 9) does not beat one that is steady
    (zen: 3 after a cold first sync of 20, which is left out)."""
    sparse, _ = _sparse_and_dense()
    times = {"zen": [20.0, 3.0], "hc": [1.0, 9.0], "agsparse": [5.0], "sparse_ps": [6.0], "dense": [7.0]}
    schemes = [SequencedAuto(times, reprofile_every=100, trials=3) for _ in range(4)]
    ran = _auto_run([sparse] * 15, schemes)  # dense is pruned by bytes: 3 candidates x 3 trials + zen x 2
    assert ran[0] == "zen" and ran[1:12].count("zen") == 2 and ran[1:12].count("hc") == 3
    assert ran[12:] == ["zen"] * 3
    assert schemes[0].agreed["zen"] == 3.0 and schemes[0].agreed["hc"] == 9.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("average", [False, True])
def test_dense_ring_lands_in_place_where_send_copies_with_the_same_bits(monkeypatch, dtype, average):
    """Over a communicator whose send copies (as tcp:// and ucx:// do), the allgather lands in the rank's
    own dense copy; the bits equal the path that lands in a fresh tensor (in-process references)."""
    import zend.core.schemes.dense as dense_scheme
    from zend.core import Channel
    from zend.core.comm import Communicator
    from zend.transport.inproc import InProcessCluster

    class Copying(Communicator):
        sends_copy = True

        def __init__(self, inner):
            self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

        def send(self, dst, tag, payload):
            self.inner.send(dst, tag, payload.clone())

        def recv(self, src, tag, timeout_s=None):
            return self.inner.recv(src, tag, timeout_s)

    monkeypatch.setattr(dense_scheme, "PIECE_BYTES", 96)  # several pieces per chunk
    torch.manual_seed(5)
    grads = [SparseGrad(torch.randint(0, 203, (40,)), torch.randn(40, 5).to(dtype), 203, "g") for _ in range(4)]
    allocated = []
    real_empty_like = torch.empty_like
    monkeypatch.setattr(dense_scheme.torch, "empty_like", lambda t: allocated.append(t) or real_empty_like(t))

    def run(wrap):
        return InProcessCluster(4).run(lambda rank, comm: dense_scheme.DenseScheme().sync(
            Channel(wrap(comm), "s"), grads[rank], average=average))

    fresh = run(lambda c: c)
    assert len(allocated) == 4  # one result tensor per rank
    in_place = run(Copying)
    assert len(allocated) == 4  # none more: landed in place
    for a, b in zip(fresh, in_place, strict=True):
        assert torch.equal(a.grad.values, b.grad.values)
    assert_close_to(in_place[0].to_dense(), reference_sum(grads) / (4 if average else 1), dtype, 4)


@st.composite
def row_sets(draw):
    """n = 1..4 ranks' gradients of one tensor: any row sets (some ranks empty), duplicates, and rows
    whose values sum to an exact zero (+1 from rank 0, -1 from rank 1)."""
    n = draw(st.integers(1, 4))
    num_rows = draw(st.integers(1, 200))
    row_shape = draw(st.sampled_from([(), (1,), (4,), (2, 3), (70,)]))  # 70: rows straddle omnireduce's blocks
    dtype = draw(st.sampled_from(DTYPES))
    rows = [draw(st.lists(st.integers(0, num_rows - 1), max_size=40)) for _ in range(n)]
    zero_sum = sorted(draw(st.sets(st.integers(0, num_rows - 1), max_size=5))) if n >= 2 else []
    grads = []
    for rank, picked in enumerate(rows):
        values = torch.randn(len(picked), *row_shape)
        if rank < 2 and zero_sum:
            picked = [r for r in picked if r not in zero_sum] + zero_sum
            sign = 1.0 if rank == 0 else -1.0
            values = torch.cat([torch.randn(len(picked) - len(zero_sum), *row_shape),
                                torch.full((len(zero_sum), *row_shape), sign)])
        grads.append(SparseGrad(torch.tensor(picked, dtype=torch.int64), values.to(dtype), num_rows, "g"))
    return grads


@pytest.mark.parametrize("scheme", ALL)
@given(grads=row_sets())
def test_every_scheme_returns_exactly_the_rows_sent(scheme, grads):
    """The result's rows are the union of every rank's rows: no row nobody sent (the dense ring and
    omnireduce densify on the way), and a row that sums to zero stays (gloo keeps it too)."""
    sent = sorted(set().union(*(g.indices.tolist() for g in grads)))
    expected = reference_sum(grads)
    for r in run_scheme(scheme, grads):
        assert r.grad.indices.tolist() == sent
        assert r.grad.coalesced and r.grad.values.shape == (len(sent), *grads[0].row_shape)
        assert_close_to(r.to_dense(), expected, grads[0].dtype, len(grads))


def test_a_peers_row_bitmap_with_a_bit_past_the_tensor_fails_naming_it():
    from zend.core import Channel
    from zend.core.codec import PeerMessageError
    from zend.core.comm import Communicator
    from zend.transport.inproc import InProcessCluster

    class Lying(Communicator):  # rank 1 sets bit 10 of a 10-row tensor in its bitmap
        def __init__(self, inner):
            self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

        def send(self, dst, tag, payload):
            if self.rank == 1 and "/rows/" in tag and payload.numel() == 1:
                payload = payload.clone() | 0b100
            self.inner.send(dst, tag, payload)

        def recv(self, src, tag, timeout_s=None):
            return self.inner.recv(src, tag, timeout_s)

    grads = [SparseGrad(torch.tensor([row]), torch.ones(1), 10, "g") for row in (0, 9)]

    def run(rank, comm):
        try:
            make_scheme("dense").sync(Channel(Lying(comm), "s", timeout_s=2), grads[rank])
        except PeerMessageError as exc:
            return str(exc)
        except CommError as exc:  # rank 1: rank 0 stopped at the bad piece (a daemon aborts the step)
            return str(exc)
        return "no error"

    from zend.core import CommError, make_scheme

    outcome = InProcessCluster(2).run(run)
    assert "rank 1 sent rank 0 a bad rows message" in outcome[0] and "past the tensor's 10 rows" in outcome[0]


@given(rows=st.lists(st.integers(0, 99), max_size=60), num_rows=st.integers(100, 130))
def test_row_bitmaps_round_trip_on_the_host_and_in_torch_ops(rows, num_rows):
    """The numpy pack (CPU) and the torch twin (CUDA tensors) give the same bytes and the same rows."""
    from zend.core.schemes import rowset

    picked = torch.tensor(rows, dtype=torch.int64)
    host = rowset.bitmap_of(picked, num_rows)
    assert torch.equal(host, rowset._bitmap_on_device(picked, (num_rows + 7) // 8))
    assert rowset.rows_of(host, num_rows).tolist() == sorted(set(rows))
    assert rowset._rows_on_device(host, num_rows).tolist() == sorted(set(rows))
