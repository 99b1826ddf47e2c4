"""The client never builds a sparse tensor from rows it has not checked (issue 14, item 3): a result
whose row lies outside the tensor raises zen.InvalidGradient naming the tensor, instead of a tensor
that writes outside its memory in the next op. Unit-level: no daemon."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zen
from torch.distributed import ReduceOp
from zen.client import Client, checked_rows
from zen.distributed import ZenProcessGroup

from zend.core.sparse import SparseGrad

pytestmark = pytest.mark.inprocess

ROWS = 10


def test_checked_rows_passes_rows_in_range_and_names_the_first_one_outside() -> None:
    rows = torch.tensor([0, 3, ROWS - 1])
    assert checked_rows(rows, ROWS, "emb") is rows
    assert checked_rows(torch.empty(0, dtype=torch.int64), 0, "emb").numel() == 0
    with pytest.raises(zen.InvalidGradient, match=r"tensor 'emb': the result holds row 10, outside \[0, 10\)"):
        checked_rows(torch.tensor([1, ROWS]), ROWS, "emb")
    with pytest.raises(zen.InvalidGradient, match="row -1"):
        checked_rows(torch.tensor([-1, 2]), ROWS, "emb")


def test_a_sparse_result_with_a_row_past_the_end_is_refused_before_the_tensor_is_built() -> None:
    original = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 3), (ROWS, 3), check_invariants=True)
    good = SparseGrad(torch.tensor([1, 2]), torch.ones(2, 3), ROWS, "emb", True)
    built = Client._as_output(good, "sparse", (ROWS, 3), original)
    assert torch.equal(built.to_dense(), original.to_dense())
    bad = SparseGrad(torch.tensor([1, ROWS + 5]), torch.ones(2, 3), ROWS, "emb", True)
    with pytest.raises(zen.InvalidGradient, match=r"tensor 'emb': the result holds row 15, outside \[0, 10\)"):
        Client._as_output(bad, "sparse", (ROWS, 3), original)


def test_a_topk_result_with_an_element_past_the_end_is_refused_before_it_is_scattered() -> None:
    original = torch.zeros(2, 3)
    good = SparseGrad(torch.tensor([0, 5]), torch.ones(2), 6, "w", True)
    assert Client._as_output(good, "topk", (6,), original).tolist() == [[1, 0, 0], [0, 0, 1]]
    bad = SparseGrad(torch.tensor([0, 6]), torch.ones(2), 6, "w", True)
    with pytest.raises(zen.InvalidGradient, match=r"tensor 'w': the result holds row 6, outside \[0, 6\)"):
        Client._as_output(bad, "topk", (6,), original)


def test_allreduce_many_checks_each_tensors_rows() -> None:
    """Two tensors fused (rows 0-9, then 10-13): the result is cut where the second begins, which takes
    sorted rows; unsorted, the second tensor's part would hold row 5 - 10."""
    client = Client.__new__(Client)
    client._fused_into = {}
    answer = (torch.tensor([1, 12, 5]), torch.ones(3, 2))
    client.allreduce = lambda *a, **k: answer  # type: ignore[method-assign]
    a = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (ROWS, 2), check_invariants=True)
    b = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2), check_invariants=True)
    with pytest.raises(zen.InvalidGradient, match=r"tensor 'b': the result holds row -5, outside \[0, 4\)"):
        client.allreduce_many([a, b], names=["a", "b"])
    answer = (torch.tensor([1, 11, 13]), torch.ones(3, 2))
    out = client.allreduce_many([a, b], names=["a", "b"])
    assert out[1]._indices().tolist() == [[1, 3]]


def test_the_torch_backend_checks_the_rows_before_it_builds_the_sum() -> None:
    """ZenProcessGroup's sparse all_reduce, with the group's parts it uses stubbed: the client answers a
    row past the end of the tensor's folded rows."""
    answer: list[Any] = [(torch.tensor([0, 7 * 3]), torch.ones(2, 2))]  # a (7, 3, 2) tensor folds to 21 rows
    group = SimpleNamespace(
        prefix="pg0.", timeout=timedelta(seconds=5), fuse=False, _zen_carries=lambda t, what: True,
        _name_of=lambda identity, t: "pg0." + identity,
        client=SimpleNamespace(allreduce=lambda *a, **k: answer[0]),
        _submit=lambda name, compute, deliver, like: deliver(compute()))
    group._submit_one = lambda *a: ZenProcessGroup._submit_one(group, *a)  # type: ignore[arg-type]
    t = torch.sparse_coo_tensor(torch.tensor([[0, 6], [0, 2]]), torch.ones(2, 2), (7, 3, 2), check_invariants=True)
    with pytest.raises(zen.InvalidGradient, match=r"the result holds row 21, outside \[0, 21\)"):
        ZenProcessGroup._sparse_allreduce(group, [t.clone()], ReduceOp.SUM)  # type: ignore[arg-type]
    answer[0] = (torch.tensor([0, 20]), torch.ones(2, 2))
    delivered: Any = ZenProcessGroup._sparse_allreduce(group, [t.clone()], ReduceOp.SUM)  # type: ignore[arg-type]
    (out,) = delivered  # the stub's _submit returns what deliver returns: the tensors
    assert out.coalesce()._indices().tolist() == [[0, 6], [0, 2]]


def test_allreduce_many_cuts_a_kind_where_its_rows_would_pass_a_zen_tensors_limit() -> None:
    """Three tables of 1e9 rows each (one width) are under 2**31 alone, not all three stacked: they go as two
    fused tensors, each under the limit, and every row comes back to its own table."""
    client = Client.__new__(Client)
    client._fused_into = {}
    steps: list[tuple[str, int]] = []

    def allreduce(pair: Any, *, name: str, num_rows: int, **_: Any) -> Any:
        steps.append((name, num_rows))
        return pair

    client.allreduce = allreduce  # type: ignore[method-assign]
    big = 1_000_000_000
    tables = [torch.sparse_coo_tensor(torch.tensor([[k, big - 1]]), torch.ones(2, 2), (big, 2), check_invariants=True)
              for k in range(3)]
    out = client.allreduce_many(tables, names=["a", "b", "c"])
    assert [n for _, n in steps] == [2 * big, big] and steps[0][0] != steps[1][0], steps
    for k, t in enumerate(out):
        assert t._indices().tolist() == [[k, big - 1]], (k, t)
