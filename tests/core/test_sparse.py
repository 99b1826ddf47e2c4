import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from zend.core import SparseGrad, SparseGradError, TopKCompressor, from_dense, from_torch_sparse, sparse
from zend.core.sparse import sum_by_slot, sum_by_sort

pytestmark = pytest.mark.inprocess


def embedding_grad(ids: list[int], rows: int = 50, dim: int = 4) -> torch.Tensor:
    torch.manual_seed(0)
    emb = nn.Embedding(rows, dim, sparse=True)
    emb(torch.tensor(ids)).pow(2).sum().backward()
    assert emb.weight.grad is not None
    return emb.weight.grad


def test_uncoalesced_embedding_gradient_with_duplicates():
    grad = embedding_grad([3, 7, 3, 3, 9, 7])
    assert not grad.is_coalesced()
    sg = from_torch_sparse(grad, "emb")
    assert sg.nnz == 6 and not sg.coalesced
    co = sg.coalesce()
    assert co.coalesced and co.indices.tolist() == [3, 7, 9]
    torch.testing.assert_close(co.to_dense(), grad.to_dense())
    torch.testing.assert_close(sg.to_dense(), grad.to_dense())  # duplicates summed either way


def test_round_trip_through_torch_sparse():
    grad = embedding_grad([1, 2, 2, 40])
    sg = from_torch_sparse(grad).coalesce()
    back = sg.to_torch_sparse()
    assert back.is_coalesced()
    torch.testing.assert_close(back.to_dense(), grad.to_dense())


def test_element_sparse_from_multidimensional_coo():
    dense = torch.zeros(3, 4)
    dense[0, 1], dense[2, 3] = 1.5, -2.0
    sg = from_torch_sparse(dense.to_sparse())  # sparse in both dims: flattened
    assert sg.num_rows == 12 and sg.row_shape == ()
    assert sg.indices.tolist() == [1, 11]
    torch.testing.assert_close(sg.to_dense().reshape(3, 4), dense)


def test_from_dense_keeps_non_zero_rows():
    dense = torch.zeros(6, 2)
    dense[1] = torch.tensor([0.0, 3.0])
    dense[4] = torch.tensor([1.0, 1.0])
    sg = from_dense(dense)
    assert sg.indices.tolist() == [1, 4] and sg.coalesced
    torch.testing.assert_close(sg.to_dense(), dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_coalesce_sums_in_float32_then_rounds_once(dtype):
    idx = torch.tensor([5, 5, 5, 5])
    vals = torch.full((4, 2), 0.1).to(dtype)
    co = SparseGrad(idx, vals, 10).coalesce()
    expected = (vals.float().sum(0)).to(dtype)
    assert torch.equal(co.values[0], expected)



@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(0, 63), min_size=1, max_size=300),
    row_shape=st.sampled_from([(), (1,), (3,), (2, 2)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_slot_per_row_sums_duplicates_to_the_same_bits_as_the_stable_sort(rows, row_shape, dtype, seed):
    idx = torch.tensor(rows)
    vals = torch.randn((len(rows), *row_shape), generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = SparseGrad(idx, vals, 64).flat_values()
    by_slot, by_sort = sum_by_slot(idx, flat, 64), sum_by_sort(idx, flat, deterministic=True)
    assert torch.equal(by_slot[0], by_sort[0]) and torch.equal(by_slot[1], by_sort[1])
    assert by_slot[0].tolist() == sorted(set(rows))


def test_a_slot_per_row_gives_the_sorts_bits_at_a_recommenders_size_too():
    """The sizes where torch's kernels may take other paths (vectorised, chunked) than the property test's."""
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 20_000, (200_000,), generator=g)
    vals = torch.randn(200_000, 16, generator=g)
    by_slot, by_sort = sum_by_slot(idx, vals, 20_000), sum_by_sort(idx, vals, deterministic=True)
    assert torch.equal(by_slot[0], by_sort[0]) and torch.equal(by_slot[1], by_sort[1])


@pytest.mark.parametrize("num_rows, slot", [(16 * 6, True), (16 * 6 + 1, False)])
def test_coalesce_takes_a_slot_per_row_only_while_the_table_is_small_beside_the_rows_given(
        monkeypatch, num_rows, slot):
    taken = []
    monkeypatch.setattr(sparse, "sum_by_slot", lambda *a: taken.append("slot") or sum_by_sort(a[0], a[1], True))
    monkeypatch.setattr(sparse, "sum_by_sort", lambda *a: taken.append("sort") or sum_by_sort(*a))
    co = SparseGrad(torch.tensor([9, 2, 9, 0, 2, 9]), torch.arange(6.0), num_rows).coalesce()
    assert taken == ["slot" if slot else "sort"]
    assert co.indices.tolist() == [0, 2, 9] and co.values.tolist() == [3.0, 5.0, 7.0]


@pytest.mark.parametrize(
    "grad, match",
    [  # (gradient, the error it must raise)
        (SparseGrad(torch.tensor([0, -3]), torch.ones(2, 2), 10, "emb"), r"'emb'.*negative index -3"),
        (SparseGrad(torch.tensor([0, 10]), torch.ones(2, 2), 10, "emb"),
         r"'emb'.*index 10 out of range for 10 rows"),
        (SparseGrad(torch.tensor([0, 1]), torch.ones(3, 2), 10, "emb"),
         r"'emb'.*2 indices but values of shape \(3, 2\)"),
        (SparseGrad(torch.tensor([0]), torch.ones(1, 2, dtype=torch.float64), 10, "w"),
         r"'w'.*value dtype torch.float64"),
        (SparseGrad(torch.tensor([0], dtype=torch.int16), torch.ones(1, 2), 10, "w"), r"'w'.*index dtype torch.int16"),
        (SparseGrad(torch.tensor([[0]]), torch.ones(1, 2), 10, "w"), r"'w'.*indices must be 1-D"),
        (SparseGrad(torch.tensor([2, 4]), torch.tensor([[1.0, 2.0], [math.nan, 0.0]]), 10, "emb"),
         r"'emb'.*non-finite value nan in row 4"),
        (SparseGrad(torch.tensor([2]), torch.tensor([[math.inf, 0.0]]), 10, "emb"),
         r"'emb'.*non-finite value inf in row 2"),
    ],
)
def test_validation_names_tensor_and_value(grad, match):
    with pytest.raises(SparseGradError, match=match):
        grad.validate()


def test_nonfinite_pass_policy_lets_values_through():
    grad = SparseGrad(torch.tensor([2]), torch.tensor([[math.inf, 0.0]]), 10, "emb")
    assert grad.validate(nonfinite="pass") is grad
    with pytest.raises(SparseGradError, match="policy 'maybe'"):
        grad.validate(nonfinite="maybe")  # type: ignore[arg-type]


def test_mismatched_trailing_shapes_are_named():
    a = SparseGrad(torch.tensor([0]), torch.ones(1, 4), 10, "a")
    b = SparseGrad(torch.tensor([0]), torch.ones(1, 5), 10, "b")
    with pytest.raises(SparseGradError, match=r"'a': dense shape \(10, 4\) != \(10, 5\) of 'b'"):
        a.check_compatible(b)


def test_not_sparse_input_is_rejected():
    with pytest.raises(SparseGradError, match="expected a sparse COO tensor"):
        from_torch_sparse(torch.ones(3), "x")


def test_topk_error_feedback_delays_but_never_drops():
    comp = TopKCompressor(ratio=0.25)
    torch.manual_seed(1)
    grads = [torch.randn(4, 5) for _ in range(6)]
    sent = torch.zeros(4, 5)
    for g in grads:
        sparse = comp.compress("w", g)
        assert sparse.nnz == 5  # ceil(0.25 * 20)
        sent += TopKCompressor.decompress(sparse, g.shape)
    # what was sent plus what is still held back equals everything that came in
    torch.testing.assert_close(sent + comp.residuals["w"].reshape(4, 5), sum(grads))


def test_topk_keeps_the_largest_magnitudes():
    comp = TopKCompressor(ratio=0.5)
    sparse = comp.compress("w", torch.tensor([0.1, -5.0, 0.2, 3.0]))
    assert sparse.indices.tolist() == [1, 3]
    assert sparse.values.tolist() == [-5.0, 3.0]


def test_topk_rejects_bad_ratio_and_shape_change():
    with pytest.raises(SparseGradError, match="ratio 0"):
        TopKCompressor(0)
    comp = TopKCompressor(0.5)
    comp.compress("w", torch.ones(4))
    with pytest.raises(SparseGradError, match=r"'w'.*differs"):
        comp.compress("w", torch.ones(5))


def test_allocator_tuning_reports_success_on_glibc():
    from zend.runtime.tuning import tune_allocator

    assert tune_allocator() is True  # our machines run glibc; elsewhere it returns False
