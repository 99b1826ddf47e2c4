import contextlib
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zend.core.hashing import SeededHash
from zend.core.partition import BlockRangePartitioner, RowRangePartitioner, ZenPartitioner
from zend.core.schemes.base import imbalance
from zend.core.sparse import SparseGrad
from zend.simulator.traces import TokenTrace

pytestmark = pytest.mark.inprocess


def test_hash_is_seeded_and_in_range():
    x = torch.arange(100_000)
    a, b, c = SeededHash(1, 13)(x), SeededHash(1, 13)(x), SeededHash(2, 13)(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) == 0 and int(a.max()) == 12
    counts = torch.bincount(a, minlength=13).double()
    assert float(counts.max() / counts.mean()) < 1.05  # uniform over a range of keys


def test_hash_does_not_modify_its_input():
    x = torch.arange(10)
    SeededHash(0, 4)(x)
    assert x.tolist() == list(range(10))


@st.composite
def sparse_grads(draw):
    num_rows = draw(st.integers(1, 400))
    rows = draw(st.sets(st.integers(0, num_rows - 1), max_size=num_rows))
    row_len = draw(st.sampled_from([1, 2, 3, 8, 12, 16, 64, 100]))
    idx = torch.tensor(sorted(rows), dtype=torch.int64)
    values = torch.randn(len(idx), row_len)
    return SparseGrad(idx, values if row_len > 1 else values.squeeze(1), num_rows, "g", True)


@given(sparse_grads(), st.integers(1, 20), st.integers(0, 2**40), st.sampled_from([1, 4, 8]))
def test_zen_partition_is_lossless_and_keys_stay_in_domain(grad, n, seed, min_slice):
    parts = ZenPartitioner(grad.num_rows, grad.row_len, n, seed, min_slice)
    split = parts.split(grad)
    assert len(split) == n
    for j, part in enumerate(split):
        assert part.values.shape == (part.count, parts.unit_width)
        if part.count:
            assert int(part.keys.min()) >= 0 and int(part.keys.max()) < parts.domain_size(j)
            assert part.keys.unique().numel() == part.count
    assert sum(p.count for p in split) == grad.nnz * parts.slices
    back = parts.assemble(split, grad)
    assert torch.equal(back.indices, grad.indices) and torch.equal(back.values, grad.values)


@given(sparse_grads(), st.integers(1, 9))
def test_range_partitioners_are_lossless(grad, n):
    for parts in (RowRangePartitioner(grad.num_rows, grad.row_len, n),
                  BlockRangePartitioner(grad.num_rows, grad.row_len, n, block=16)):
        split = parts.split(grad)
        back = parts.assemble(split, grad)
        assert torch.equal(back.to_dense(), grad.to_dense())


def test_domain_metadata_is_nothing_and_bitmaps_cover_the_tensor_once():
    """Domains are computed, not stored; summed over partitions they are one bit per slot."""
    parts = ZenPartitioner(num_rows=100_003, row_len=1, num_parts=7, seed=3)
    assert not any(isinstance(v, torch.Tensor) for v in vars(parts).values())
    total = sum(parts.domain_size(j) for j in range(7))
    assert 100_003 <= total < 100_003 + 7  # the last block is padded
    # Every row appears in exactly one domain, at the key the partitioner gives it.
    rows = torch.arange(100_003)
    grad = SparseGrad(rows, torch.zeros(100_003), 100_003, "g", True)
    seen = torch.zeros(100_003, dtype=torch.int64)
    for j, part in enumerate(parts.split(grad)):
        decoded, _ = parts.rows_of(j, part.keys)
        seen[decoded] += 1
    assert bool((seen == 1).all())


def _trace_imbalance(partitioner_for, n: int, dim: int, steps: int = 3):
    trace = TokenTrace.default()
    push, pull = [], []
    for step in range(steps):
        grads = [trace.embedding_grad(w, step, dim) for w in range(n)]
        parts = partitioner_for(grads[0])
        splits = [parts.split(g) for g in grads]
        push.append(max(imbalance([p.count for p in s]) for s in splits))
        union = torch.unique(torch.cat([g.indices for g in grads]))
        union_grad = SparseGrad(union, torch.zeros(len(union), dim), grads[0].num_rows, "u", True)
        pull.append(imbalance([p.count for p in parts.split(union_grad)]))
    return max(push), max(pull)


def test_zen_is_balanced_on_the_real_trace_at_16_ranks():
    """GPT-2 embedding (768 wide) on real English text: ZEN within 1.1, even ranges skewed."""
    push, pull = _trace_imbalance(lambda g: ZenPartitioner(g.num_rows, g.row_len, 16, seed=11), 16, 768)
    assert push <= 1.1 and pull <= 1.1, (push, pull)
    push_r, pull_r = _trace_imbalance(lambda g: RowRangePartitioner(g.num_rows, g.row_len, 16), 16, 768)
    assert push_r >= 2 and pull_r >= 2, (push_r, pull_r)


@pytest.mark.parametrize("dim", [1, 8])
def test_narrow_rows_hash_better_than_ranges_on_the_real_trace(dim):
    """Narrow rows are hashed whole: balls into bins, still far better than even ranges."""
    push, pull = _trace_imbalance(lambda g: ZenPartitioner(g.num_rows, g.row_len, 16, seed=11), 16, dim, steps=2)
    push_r, pull_r = _trace_imbalance(lambda g: RowRangePartitioner(g.num_rows, g.row_len, 16), 16, dim, steps=2)
    assert push < 1.6 and pull < 1.3, (push, pull)
    assert push_r > 3 * (push - 1) + 1 and pull_r > 2 * pull, (push_r, pull_r)


def test_slices_divide_the_row():
    assert ZenPartitioner(10, 768, 16, 0).slices == 16
    assert ZenPartitioner(10, 768, 5, 0).slices == 4
    assert ZenPartitioner(10, 7, 16, 0).slices == 1
    assert ZenPartitioner(10, 64, 128, 0, min_slice_width=8).slices == 8
    np.testing.assert_equal(ZenPartitioner(10, 64, 128, 0).unit_width, 8)


@contextlib.contextmanager
def _kernels_off():
    from zend.core import kernels

    old = os.environ.get(kernels.DISABLE_ENV)
    os.environ[kernels.DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[kernels.DISABLE_ENV]
        else:
            os.environ[kernels.DISABLE_ENV] = old


@given(sparse_grads(), st.integers(2, 9), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_compiled_assembly_matches_the_torch_twin_bit_for_bit(grad, n, dtype):
    from zend.core import kernels

    assert kernels.available()  # numba is a dependency: the compiled path must be the one under test
    grad = grad.with_values(grad.values.to(dtype))
    parts = ZenPartitioner(grad.num_rows, grad.row_len, n, seed=5)
    split = parts.split(grad)
    compiled = parts.assemble(split, grad)
    with _kernels_off():
        assert not kernels.available()
        twin = parts.assemble(split, grad)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(compiled.indices, twin.indices) and torch.equal(compiled.indices, grad.indices.long())
    assert torch.equal(compiled.values.view(bits), twin.values.view(bits))
    assert torch.equal(compiled.values.view(bits), grad.values.view(bits))


@pytest.mark.parametrize("compiled", [True, False])
def test_pulled_key_past_the_last_row_is_refused(compiled):
    from zend.core.partition import Part

    parts = ZenPartitioner(num_rows=10, row_len=1, num_parts=4, seed=0)  # blocks of 4: rows 10 and 11 do not exist
    # key 2 is block 2 (rows 8-11); the rotation sends it to a different row in each partition
    j = next(j for j in range(4) if int(parts.rows_of(j, torch.tensor([2]))[0][0]) >= 10)
    empty = Part(torch.tensor([], dtype=torch.int64), torch.ones(0, 1))
    pulled = [Part(torch.tensor([2]), torch.ones(1, 1)) if i == j else empty for i in range(4)]
    with contextlib.nullcontext() if compiled else _kernels_off(), pytest.raises(ValueError, match="outside the"):
        parts.assemble(pulled, SparseGrad.empty(10))


@given(sparse_grads(), st.integers(1, 20), st.sampled_from([1, 4, 8]))
def test_compiled_split_matches_the_torch_twin(grad, n, min_slice):
    parts = ZenPartitioner(grad.num_rows, grad.row_len, n, seed=9, min_slice_width=min_slice)
    compiled = parts.split(grad)
    with _kernels_off():
        twin = parts.split(grad)
    for a, b in zip(compiled, twin, strict=True):
        assert a.keys.dtype == b.keys.dtype and torch.equal(a.keys, b.keys)
        assert torch.equal(a.values, b.values)


@given(st.lists(st.sets(st.integers(0, 10_000), max_size=60), min_size=1, max_size=16))
def test_merging_sorted_runs_gives_their_union_and_every_key_its_slot(sets):
    from zend.core import kernels

    runs = [np.array(sorted(s), dtype=np.int64) for s in sets]
    union, slot = kernels.merge_runs(runs)
    assert union.tolist() == sorted(set().union(*sets))
    assert np.array_equal(union[slot], np.concatenate(runs))


def _large_row_grad(n: int, nnz: int, seed: int) -> SparseGrad:
    """Rows up to the largest block the hash takes (2^31 - 1): the kernels' float division is exact there."""
    num_rows = n * (2**31 - 1) - 3
    gen = torch.Generator().manual_seed(seed)
    picked = torch.randint(0, num_rows, (nnz,), generator=gen)
    edges = torch.tensor([0, 1, n - 1, n, num_rows - 1, num_rows - n, (num_rows // n) * n, (num_rows // n) * n - 1])
    idx = torch.cat([picked, edges]).unique()
    return SparseGrad(idx, torch.randn(idx.numel()), num_rows, "g", True)


@pytest.mark.parametrize("n", [3, 12, 16, 127])
def test_compiled_split_matches_the_torch_twin_at_the_largest_rows(n):
    grad = _large_row_grad(n, 5000, n)
    parts = ZenPartitioner(grad.num_rows, 1, n, seed=4)
    compiled = parts.split(grad)
    with _kernels_off():
        twin = parts.split(grad)
    for a, b in zip(compiled, twin, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _push_messages_both_ways(grad: SparseGrad, n: int, keep: int, min_slice: int = 8):
    from zend.core.codec import encode_gathered
    from zend.core.schemes.parallel import BOTH, zen_push_messages

    parts = ZenPartitioner(grad.num_rows, grad.row_len, n, seed=3, min_slice_width=min_slice)
    fused = zen_push_messages(parts, grad, BOTH, keep)
    split = parts.split(grad)
    expected = [encode_gathered(p.keys, p.source, p.rows, parts.domain_size(j), BOTH) for j, p in enumerate(split)]
    return parts, fused, split, expected


@given(sparse_grads(), st.integers(2, 20), st.integers(0, 19), st.sampled_from([torch.float32, torch.bfloat16,
                                                                                   torch.float16]),
       st.sampled_from([1, 4, 8]))
def test_one_pass_push_messages_equal_split_then_encode_byte_for_byte(grad, n, keep, dtype, min_slice):
    """The two-pass kernel (counts, then keys and values straight into the messages) makes exactly the
    messages that splitting and then encoding each part makes, COO and bitmap alike, every dtype."""
    grad = grad.with_values(grad.values.to(dtype))
    keep %= n
    parts, fused, split, expected = _push_messages_both_ways(grad, n, keep, min_slice)
    if parts.slices != 1:
        assert fused is None  # S > 1: a partition's keys need not ascend, the split path serves
        return
    assert fused is not None
    messages, own, counts = fused
    assert counts == [p.count for p in split]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(own.keys.long(), split[keep].keys.long())
    assert torch.equal(own.values.view(bits), split[keep].values.view(bits))
    for j in range(n):
        if j != keep:
            assert torch.equal(messages[j], expected[j]), j


@pytest.mark.parametrize("n", [3, 16, 127])
def test_one_pass_push_messages_at_the_largest_rows(n):
    grad = _large_row_grad(n, 20_000, n + 1)
    _, fused, split, expected = _push_messages_both_ways(grad, n, keep=1)
    assert fused is not None
    messages, _, counts = fused
    assert counts == [p.count for p in split]
    assert all(torch.equal(messages[j], expected[j]) for j in range(n) if j != 1)


@given(st.integers(0, 2**52 - 1), st.integers(1, 2**16), st.integers(-2, 2))
def test_the_kernels_float_division_is_exact_below_its_limit(r, n, nudge):
    """_zen_slot0 divides through float64 with one correction each way: block and owner equal the
    integer formula's for any row below FAST_DIVISION_LIMIT, at and around multiples of n too."""
    from zend.core import kernels

    r = min(max(0, (r // n) * n + nudge), kernels.FAST_DIVISION_LIMIT - 1)
    h = SeededHash(7, n)
    p, b = kernels._zen_slot0(r, n, 1.0 / n, h.multiplier, h.salt)
    block = r // n
    owner = (((((block ^ h.salt) * h.multiplier) & 0xFFFFFFFF) * n) >> 32) + r - block * n
    assert (b, p) == (block, owner % n)


def test_the_kernels_float_division_at_multiples_where_the_float_falls_short():
    """r * (1/n) lands just below k for some r = k * n (155 of these 8,000 cases): the upward
    correction is what keeps the block exact there."""
    from zend.core import kernels

    for n in range(1, 2000):
        h = SeededHash(3, n)
        for k in (2**49 + 1, 2**50 // n * 3 + 7, 2**52 // n - 1, 12345678901234):
            for r in (k * n - 1, k * n, k * n + 1):
                if r >= kernels.FAST_DIVISION_LIMIT:
                    continue
                _, b = kernels._zen_slot0(r, n, 1.0 / n, h.multiplier, h.salt)
                assert b == r // n, (r, n)
