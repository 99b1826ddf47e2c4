"""The backend's tensor fusion: which calls of a backward pass go together (zen/fusion.py), and the
backend holding and sending them (zen/distributed.py) over a stand-in client."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import zen
import zen.distributed as zd
from hypothesis import given
from hypothesis import strategies as st
from zen.fusion import Batch, PassFusion, Table, batches

from tests.helpers import poll_for

pytestmark = pytest.mark.inprocess


def test_tables_of_one_kind_share_a_step_as_rows_of_their_common_width_while_that_is_64_bytes() -> None:
    f32 = [Table("f32", 256, 4, 10), Table("f32", 64, 4, 5), Table("f32", 3, 4, 2), Table("bf16", 64, 2, 7),
           Table("f32", 16, 4, 4), Table("f32", 32, 4, 9), Table("f32", 3, 4, 1), Table("f32", 128, 4, 1)]
    # 256 and 64 float32 values share rows of 64 (256 cut in 4); 16 would cut 256 in 16: a step of its
    # own, which 32 joins (cut in 2); 3 would make rows of 1: its own step, with the other 3-wide table;
    # bf16 is another kind; 128 joins the first step it fits
    assert batches(f32, 2**31) == [Batch((0, 1, 7), 64), Batch((2, 6), 3), Batch((3,), 64), Batch((4, 5), 16)]
    assert batches(f32, 2**31, max_cut=16)[0] == Batch((0, 1, 4, 5, 7), 16)
    # below 64 bytes a common divisor is not taken: a step per width, as before
    assert batches([Table("f32", 8, 4, 1), Table("f32", 4, 4, 1)], 2**31) == [Batch((0,), 8), Batch((1,), 4)]
    # rows are counted after the cut (10 rows of 256 cut into 16 are 160); a step cut off by the bound
    # takes its own members' divisor
    assert batches([Table("f32", 256, 4, 10), Table("f32", 16, 4, 10)], 170) == [Batch((0,), 256), Batch((1,), 16)]


@given(st.lists(st.tuples(st.sampled_from(["f32", "bf16"]), st.sampled_from([0, 1, 3, 4, 8, 16, 24, 64, 96, 256]),
                          st.integers(0, 50)), max_size=12), st.integers(1, 400))
def test_every_table_goes_in_one_step_of_its_kind_cut_evenly_within_the_bounds(
        specs: list[tuple[str, int, int]], max_rows: int) -> None:
    tables = [Table(kind, width, 4 if kind == "f32" else 2, rows) for kind, width, rows in specs]
    plan = batches(tables, max_rows)
    assert plan == batches(tables, max_rows)  # every trainer plans alike
    assert sorted(i for b in plan for i in b.members) == list(range(len(tables)))
    assert [b.members[0] for b in plan] == sorted(b.members[0] for b in plan)
    for b in plan:
        members = [tables[i] for i in b.members]
        assert list(b.members) == sorted(b.members) and len({t.kind for t in members}) == 1
        widths = {t.row_numel for t in members}
        if len(widths) > 1:  # shared rows: a common divisor no narrower than 64 bytes, rows cut in 4 at most
            assert b.width > 0 and b.width * members[0].itemsize >= 64
            assert all(w % b.width == 0 and w // b.width <= 4 for w in widths)
        else:
            assert b.width == widths.pop()
        cut_rows = sum(t.rows * (t.row_numel // b.width if b.width else 1) for t in members)
        assert cut_rows < max_rows or len(members) == 1


def test_the_first_pass_is_learned_then_each_pass_goes_whole_at_its_last_call() -> None:
    f: PassFusion[str] = PassFusion()
    assert [f.arrive(1, n, n) for n in "abc"] == [["a"], ["b"], ["c"]]  # nothing learned yet
    assert [f.arrive(2, n, n) for n in "abc"] == [[], [], ["a", "b", "c"]]
    assert [f.arrive(3, n, n) for n in "abc"] == [[], [], ["a", "b", "c"]]


def test_a_pass_that_departs_sends_what_it_held_at_once_and_is_learned_anew() -> None:
    f: PassFusion[str] = PassFusion()
    for n in "abc":
        f.arrive(1, n, n)
    assert f.arrive(2, "a", "a") == []
    assert f.arrive(2, "x", "x") == ["a", "x"]  # departs: held and this one, now
    assert f.arrive(2, "c", "c") == ["c"]  # the rest of the pass one by one
    assert [f.arrive(3, n, n) for n in "axc"] == [[], [], ["a", "x", "c"]]  # pass 2 was learned


def test_release_hands_over_what_is_held_and_a_pass_with_one_call_is_never_held() -> None:
    f: PassFusion[str] = PassFusion()
    for n in "ab":
        f.arrive(1, n, n)
    assert f.arrive(2, "a", "a") == [] and f.holding
    assert f.release() == ["a"] and not f.holding
    assert f.arrive(2, "b", "b") == ["b"]  # its partner left early: not held for nothing
    g: PassFusion[str] = PassFusion()
    assert [g.arrive(p, "a", "a") for p in (1, 2, 3)] == [["a"], ["a"], ["a"]]


def test_calls_an_earlier_pass_still_holds_are_handed_back_as_stale_and_the_new_pass_fuses() -> None:
    f: PassFusion[str] = PassFusion()
    for n in "ab":
        f.arrive(1, n, n)
    assert f.arrive(2, "a", "a1") == []
    assert f.stale(2) == []  # its own pass: not stale
    assert f.stale(3) == ["a1"] and not f.holding  # pass 2's end was never seen
    assert [f.arrive(3, n, n) for n in "ab"] == [[], ["a", "b"]]


class _Client:
    """A stand-in for zen.Client over a world of one (a sum is its input); allreduce_many is the real one."""

    job, world_size, local_world_size = "fake", 1, 1

    def __init__(self) -> None:
        self.ran: list[str] = []
        self._fused_into: dict[str, str] = {}

    def allreduce(self, tensor, *, name, num_rows=None, average=False, timeout_s=None, topk=None):  # type: ignore[no-untyped-def]
        self.ran.append(name)
        rows, values = tensor
        order = torch.argsort(rows)
        return rows[order], values[order]

    def allreduce_many(self, tensors, *, names, average=False, timeout_s=None):  # type: ignore[no-untyped-def]
        return zen.Client.allreduce_many(self, tensors, names=names, average=average, timeout_s=timeout_s)  # type: ignore[arg-type]

    def last_stats(self, name: str) -> None:
        return None


def _group(client: _Client) -> zd.ZenProcessGroup:
    return zd.ZenProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=30), "9", zd.Options(client=client))  # type: ignore[arg-type]


def _table(rows: list[int], width: int, n: int = 20) -> torch.Tensor:
    return torch.sparse_coo_tensor([rows], torch.arange(len(rows) * width, dtype=torch.float32).reshape(-1, width),
                                   (n, width), check_invariants=True)


def _backward_calling(pg: zd.ZenProcessGroup, tables: list[torch.Tensor], works: list, wait_at: int = -1) -> None:
    """One backward pass whose hook makes one sparse all_reduce per table (as DDP's reducer does)."""
    x = torch.ones(1, requires_grad=True)
    y = x * 2

    def hook(grad: torch.Tensor) -> torch.Tensor:
        for i, t in enumerate(tables):
            works.append(pg.allreduce([t]))
            if i == wait_at:
                works[-1].wait()  # a caller that waits inside the pass: the held call goes at once
        return grad

    y.register_hook(hook)
    y.sum().backward()


def test_the_backend_fuses_a_learned_pass_into_one_step_per_width_with_each_sum_in_place() -> None:
    client = _Client()
    pg = _group(client)
    try:
        for backward_pass in range(3):
            tables = [_table([3, 1], 4), _table([5], 4), _table([2, 7], 2)]
            expected = [t.coalesce().to_dense() for t in tables]
            works: list = []
            ran_before = len(client.ran)
            _backward_calling(pg, tables, works)
            for w, t, want in zip(works, tables, expected, strict=True):
                assert w.wait() and w.result()[0] is t and torch.equal(t.to_dense(), want)
            ran = client.ran[ran_before:]
            if backward_pass == 0:  # learning: a step per call
                assert len(ran) == 3 and not any(n.startswith("fused:") for n in ran), ran
            else:  # widths 4 and 2: two fused steps
                assert len(ran) == 2 and all(n.startswith("fused:") for n in ran), ran
    finally:
        pg.shutdown()


def test_a_held_call_goes_when_waited_on_and_a_pass_that_stops_short_sends_it_at_its_end() -> None:
    client = _Client()
    pg = _group(client)
    try:
        _backward_calling(pg, [_table([1], 4), _table([2], 4), _table([3], 4)], [])  # learned: three calls
        works: list = []
        _backward_calling(pg, [_table([1], 4), _table([2], 4), _table([3], 4)], works, wait_at=0)
        assert all(w.wait() for w in works)
        short: list = []
        _backward_calling(pg, [_table([4], 4)], short)  # one call of three: held, then the pass ends
        poll_for(short[0].is_completed, 10, "the held call sent at the pass's end, unwaited")
        assert torch.equal(short[0].result()[0].to_dense()[4], torch.arange(4.0))
    finally:
        pg.shutdown()


def test_shutdown_fails_a_call_still_held_with_step_aborted() -> None:
    client = _Client()
    pg = _group(client)
    _backward_calling(pg, [_table([1], 4), _table([2], 4)], [])
    works: list = []
    x = torch.ones(1, requires_grad=True)
    y = x * 2

    def hook(grad: torch.Tensor) -> torch.Tensor:
        works.append(pg.allreduce([_table([1], 4)]))  # held for its partner
        pg.abort()
        return grad

    y.register_hook(hook)
    y.sum().backward()
    with pytest.raises(zen.StepAborted, match="held"):
        works[0].wait()


def test_a_call_held_by_a_pass_that_failed_is_failed_not_sent_with_the_next_pass() -> None:
    client = _Client()
    pg = _group(client)
    try:
        _backward_calling(pg, [_table([1], 4), _table([2], 4)], [])
        works: list = []
        x = torch.ones(1, requires_grad=True)
        y = x * 2

        def failing(grad: torch.Tensor) -> torch.Tensor:
            works.append(pg.allreduce([_table([1], 4)]))  # held for its partner, which never comes
            raise RuntimeError("the backward fails here")

        y.register_hook(failing)
        with pytest.raises(RuntimeError, match="fails here"):
            y.sum().backward()
        ran = len(client.ran)
        _backward_calling(pg, [_table([1], 4), _table([2], 4)], works)
        with pytest.raises(zen.StepAborted, match="were never sent"):
            works[0].wait()
        assert works[1].wait() and works[2].wait()
        assert len(client.ran) == ran + 1 and client.ran[-1].startswith("fused:"), client.ran  # the new pass only
    finally:
        pg.shutdown()


def test_the_fusion_switch_takes_the_codes_choice_then_zen_fuse_and_names_a_bad_value() -> None:
    from zen.fusion import fuse_setting

    assert fuse_setting(None, {}) is True
    assert fuse_setting(None, {"ZEN_FUSE": "0"}) is False
    assert fuse_setting(True, {"ZEN_FUSE": "0"}) is True
    with pytest.raises(ValueError, match="ZEN_FUSE='no'"):
        fuse_setting(None, {"ZEN_FUSE": "no"})


def test_waiting_on_a_call_already_sent_leaves_the_current_pass_s_held_calls_alone() -> None:
    import threading

    client = _Client()
    gate = threading.Event()
    plain = client.allreduce

    def slow(tensor, **kwargs):  # type: ignore[no-untyped-def]
        assert gate.wait(30)
        return plain(tensor, **kwargs)

    client.allreduce = slow  # type: ignore[method-assign]
    pg = _group(client)
    try:
        gate.set()
        learning: list = []
        _backward_calling(pg, [_table([1], 4), _table([2], 4)], learning)  # learned: two calls
        assert all(w.wait() for w in learning)  # done before the gate closes
        gate.clear()
        sent: list = []
        _backward_calling(pg, [_table([1], 4), _table([2], 4)], sent)  # fused, sent, stuck at the daemon
        ran = len(client.ran)
        held: list = []
        x = torch.ones(1, requires_grad=True)
        y = x * 2

        def hook(grad: torch.Tensor) -> torch.Tensor:
            held.append(pg.allreduce([_table([1], 4)]))  # held for its partner
            with pytest.raises(zen.StepTimeout):
                sent[0].wait(timedelta(seconds=0.2))  # sent, not done: no reason to send what is held
            assert not held[0].is_completed() and pg._fusion.holding
            held.append(pg.allreduce([_table([2], 4)]))
            return grad

        y.register_hook(hook)
        y.sum().backward()
        gate.set()
        assert all(w.wait() for w in sent + held)
        # passes 2 and 3: one fused step each (the third pass's two calls went together)
        assert client.ran[ran:] == [client.ran[-1]] * 2 and client.ran[-1].startswith("fused:"), client.ran
    finally:
        gate.set()
        pg.shutdown()
