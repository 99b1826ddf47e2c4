"""A peer's message is checked as strictly as a trainer's gradient (issue 14, item 3).

One rank of an in-process cluster is hostile: its communicator rewrites what it sends in one phase
(a key past the tensor's rows in the partial last block of ZEN's hash partition, a truncated
message, a wrong dtype, a NaN). Every honest rank gets an error that names the hostile rank: the
receiver a PeerMessageError, the others the abort it sends (as NodeSteps does)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from zend.core import Channel, SparseGrad, SyncResult, make_scheme
from zend.core.codec import MAGIC, Encoding, PeerMessageError, decode_units, encode_units, read_header
from zend.core.comm import CommAborted, Communicator
from zend.core.partition import ZenPartitioner
from zend.core.sparse import NonFinitePolicy
from zend.transport.inproc import InProcessCluster

pytestmark = pytest.mark.inprocess

N, ROWS, SEED, HOSTILE = 3, 100, 7, 2  # 100 rows in blocks of 3: the last block holds row 99 alone
Rewrite = Callable[[torch.Tensor], torch.Tensor]


class Rewrites(Communicator):
    """A rank's communicator that rewrites what it sends in `phase` (to `only_to`, or to every rank)."""

    def __init__(self, inner: Communicator, phase: str, rewrite: Rewrite, only_to: int | None = None):
        self.inner, self.phase, self.rewrite, self.only_to = inner, phase, rewrite, only_to
        self.rank, self.world_size = inner.rank, inner.world_size
        self.rewritten = 0

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        if tag.split("/")[-2] == self.phase and self.only_to in (None, dst):
            payload = self.rewrite(payload)
            self.rewritten += 1
        self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        return self.inner.recv(src, tag, timeout_s)

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        self.inner.abort(prefix, reason, code)


def grads_of(rows: int = ROWS, dim: int = 4) -> list[SparseGrad]:
    """Every rank holds most rows (every partition gets units), rows 97-99 included (the last blocks)."""
    out = []
    for r in range(N):
        g = torch.Generator().manual_seed(r)
        some = torch.randperm(rows, generator=g)[: rows * 2 // 3]
        idx = torch.unique(torch.cat([some, torch.arange(rows - 3, rows)]))
        out.append(SparseGrad(idx, torch.randn(idx.numel(), dim, generator=g), rows, "emb"))
    return out


def run_hostile(scheme: str, phase: str, rewrite: Rewrite, only_to: int | None = None, dim: int = 32,
                nonfinite: NonFinitePolicy = "reject") -> list[SyncResult | BaseException]:
    grads = grads_of(dim=dim)
    hostile: list[Rewrites] = []

    def body(rank: int, comm: Communicator) -> SyncResult | BaseException:
        if rank == HOSTILE:
            comm = Rewrites(comm, phase, rewrite, only_to)
            hostile.append(comm)
        try:
            return make_scheme(scheme, seed=SEED).sync(Channel(comm, "s", timeout_s=20, nonfinite=nonfinite),
                                                       grads[rank])
        except PeerMessageError as exc:  # as NodeSteps does: the step is voided on every rank, with the reason
            comm.abort("s/", str(exc), "INVALID_ARGUMENT")
            return exc
        except CommAborted as exc:
            return exc

    out = InProcessCluster(N).run(body, timeout_s=60)
    assert hostile[0].rewritten > 0, f"{scheme} sent nothing in phase {phase!r}"
    return out


def assert_named(outcomes: list[SyncResult | BaseException], phase: str, reason: str) -> None:
    """Every honest rank failed naming the hostile rank; the receiver(s) say why. (agsparse forwards
    messages around its ring: a rank that got the bad one from an honest forwarder names both.)"""
    receivers = []
    for rank, got in enumerate(outcomes):
        if rank == HOSTILE:
            continue  # at the scheme level it may finish (agsparse); NodeSteps' commit then fails it too
        assert isinstance(got, PeerMessageError | CommAborted), (rank, got)
        assert re.search(rf"rank {HOSTILE} sent rank |rank {HOSTILE}'s gradient, forwarded", str(got)), (rank, str(got))
        if isinstance(got, PeerMessageError):
            receivers.append(got)
    assert receivers, outcomes
    for err in receivers:
        assert err.phase == phase and (err.src == HOSTILE or f"rank {HOSTILE}'s gradient" in err.reason), str(err)
        assert re.search(reason, err.reason), err.reason


# ---------------------------------------------------------------- rewrites
def truncated(msg: torch.Tensor) -> torch.Tensor:
    return msg[:-1].clone()


def as_float16(msg: torch.Tensor) -> torch.Tensor:
    """The same units with float16 values (a raw dense piece: its bytes as float16, half as long)."""
    if bytes(msg[:2].tolist()) != MAGIC:
        return msg.view(torch.float32).half().view(torch.uint8)
    h = read_header(msg)
    keys, values, _ = decode_units(msg, h.unit_width, h.domain, h.dtype)
    return encode_units(keys, values.half(), h.domain, (h.kind,), aux=h.aux)


def with_nan(msg: torch.Tensor) -> torch.Tensor:
    msg = msg.clone()
    if bytes(msg[:2].tolist()) != MAGIC:
        msg.view(torch.float32)[-1] = float("nan")
        return msg
    h = read_header(msg)
    _, values, _ = decode_units(msg, h.unit_width, h.domain, h.dtype)  # a view into msg
    values[-1, 0] = float("nan")
    return msg


def key_past_the_rows(part: int, dim: int, seed: int = SEED) -> int | None:
    """A key of partition `part`'s domain (in its last block) that decodes to a row past the tensor."""
    zen = ZenPartitioner(ROWS, dim, N, seed)
    keys = torch.arange((zen.num_blocks - 1) * zen.slices, zen.domain_size(part))
    rows, _ = zen.rows_of(part, keys)
    past = keys[rows >= ROWS]
    return int(past[0]) if past.numel() else None


def only_key(key: int, aux: int | None = None) -> Rewrite:
    """The message, replaced by one unit of key `key` (COO), in its domain."""
    def rewrite(msg: torch.Tensor) -> torch.Tensor:
        h = read_header(msg)
        return encode_units(torch.tensor([key]), torch.ones(1, h.unit_width), h.domain, (Encoding.COO,),
                            aux=1 if aux is None else aux)
    return rewrite


FIRST_PHASE = {"zen": "push", "sparse_ps": "push", "omnireduce": "push", "hc": "fold", "agsparse": "allgather",
               "dense": "reduce_scatter"}  # what rank 2 of 3 sends first


# ---------------------------------------------------------------- (a) keys
@pytest.mark.parametrize("dim", [4, 32])  # one slice per row; two (the last block's keys: 2 per partition)
def test_a_pushed_key_past_the_rows_of_the_partial_last_block_names_the_pusher(dim: int) -> None:
    target = next(j for j in range(N) if j != HOSTILE and key_past_the_rows(j, dim) is not None)
    key = key_past_the_rows(target, dim)
    assert key is not None
    out = run_hostile("zen", "push", only_key(key), only_to=target, dim=dim)
    assert isinstance(out[target], PeerMessageError)  # the receiver itself, not the owners' assemble
    assert_named(out, "push", rf"key {key} decodes to row \d+, outside partition {target}'s rows \(num_rows {ROWS}")


@pytest.mark.parametrize("num_rows", [1, 2, 5, 99, 100, 101, 50257])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("row_len", [1, 16, 64])
def test_check_keys_refuses_exactly_the_keys_that_decode_past_the_rows(num_rows: int, n: int, row_len: int) -> None:
    """Against rows_of, over every key of every partition's last block (where any bad key lies), each
    key alone and all of them at once."""
    for seed in (0, 7):
        zen = ZenPartitioner(num_rows, row_len, n, seed, min_slice_width=8)
        for part in range(n):
            keys = torch.arange((zen.num_blocks - 1) * zen.slices, zen.domain_size(part))
            rows, _ = zen.rows_of(part, keys)
            for key, row in zip(keys.tolist(), rows.tolist(), strict=True):
                if row < num_rows:
                    zen.check_keys(part, torch.tensor([key]))
                else:
                    with pytest.raises(ValueError, match=f"key {key} decodes to row {row}, outside partition {part}'s"):
                        zen.check_keys(part, torch.tensor([key]))
            if bool((rows >= num_rows).any()):
                with pytest.raises(ValueError, match="decodes to row"):
                    zen.check_keys(part, keys.flip(0))
            else:
                zen.check_keys(part, keys.flip(0))


def test_a_pulled_key_past_the_rows_names_the_owner() -> None:
    key = key_past_the_rows(HOSTILE, 32)
    assert key is not None
    out = run_hostile("zen", "pull", only_key(key), dim=32)
    assert_named(out, "pull", rf"key {key} decodes to row \d+, outside partition {HOSTILE}'s rows")


def test_a_pull_that_claims_fewer_units_received_than_it_sums_is_refused() -> None:
    out = run_hostile("zen", "pull", only_key(0, aux=0), dim=4)
    assert_named(out, "pull", r"it received 0 units for a sum of 1")


# ---------------------------------------------------------------- (b) (c) (d) every scheme
@pytest.mark.parametrize("scheme", sorted(FIRST_PHASE))
def test_a_truncated_message_names_its_sender(scheme: str) -> None:
    phase = FIRST_PHASE[scheme]
    out = run_hostile(scheme, phase, truncated)
    assert_named(out, phase, r"header promises|piece of \d+")


@pytest.mark.parametrize("scheme", sorted(FIRST_PHASE))
def test_a_message_of_another_dtype_names_its_sender(scheme: str) -> None:
    phase = FIRST_PHASE[scheme]
    out = run_hostile(scheme, phase, as_float16)
    assert_named(out, phase, r"torch.float16; expected width \d+, domain \d+, torch.float32|piece of \d+")


@pytest.mark.parametrize("scheme", sorted(FIRST_PHASE))
def test_nan_from_a_peer_is_refused_under_the_finite_policy(scheme: str) -> None:
    phase = FIRST_PHASE[scheme]
    out = run_hostile(scheme, phase, with_nan)
    assert_named(out, phase, r"non-finite value nan in ")


def test_nan_in_a_pull_names_its_owner() -> None:
    out = run_hostile("zen", "pull", with_nan)
    assert_named(out, "pull", r"non-finite value nan in key \d+")


def test_the_pass_policy_lets_a_peers_nan_through() -> None:
    out = run_hostile("zen", "push", with_nan, nonfinite="pass")
    for got in out:
        assert isinstance(got, SyncResult), got
        assert bool(torch.isnan(got.grad.values).any())


def test_a_channel_refuses_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="non-finite policy 'maybe'"):
        Channel(InProcessCluster(1).communicator(0), nonfinite="maybe")  # type: ignore[arg-type]


def test_auto_refuses_a_peers_nan_timing() -> None:
    """auto's agreement on times: a NaN time is refused, naming the rank."""
    from zend.core.schemes.auto import AutoScheme

    def body(rank: int, comm: Communicator) -> BaseException | None:
        if rank == HOSTILE:
            comm = Rewrites(comm, "auto_times", lambda m: torch.full((m.numel() // 8,), float("nan"),
                                                                      dtype=torch.float64).view(torch.uint8))
        auto = AutoScheme()
        auto.best = {"zen": (0.1,), "hc": (0.2,)}
        try:
            auto._agree(Channel(comm, "s", timeout_s=20))
        except PeerMessageError as exc:
            return exc
        return None

    out = InProcessCluster(N).run(body, timeout_s=60)
    for rank in range(N):
        if rank != HOSTILE:
            err = out[rank]
            assert isinstance(err, PeerMessageError) and err.src == HOSTILE and "not all non-negative" in err.reason


# ---------------------------------------------------------------- the dense ring's fused check
@pytest.mark.parametrize("add", [True, False])
def test_land_finite_adds_or_copies_as_torch_does_and_sees_every_nan_and_inf(add: bool) -> None:
    from zend.core import kernels

    assert kernels.available()
    g = torch.Generator().manual_seed(3)
    for size in (1, 7, 64, 1000, 4099):
        dst = torch.randn(size, generator=g)
        src = torch.randn(size, generator=g) * 3e37  # finite, but their sum overflows
        src[0] = -0.0
        expected = dst + src if add else src.clone()
        got = dst.clone()
        assert kernels.land_finite(got.numpy(), src.numpy(), add)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        assert kernels.all_finite(src.numpy())
        for bad in (float("nan"), float("inf"), float("-inf")):
            for pos in {0, size // 2, size - 1}:
                poisoned = src.clone()
                poisoned[pos] = bad
                assert not kernels.land_finite(dst.clone().numpy(), poisoned.numpy(), add), (size, pos, bad)
                assert not kernels.all_finite(poisoned.numpy()), (size, pos, bad)


@pytest.mark.parametrize("compiled", [True, False])
def test_nan_is_refused_by_the_kernels_and_their_twins(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from zend.core import kernels

    if not compiled:
        monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    assert kernels.available() is compiled
    for phase in ("reduce_scatter", "allgather"):
        out = run_hostile("dense", phase, with_nan)
        assert_named(out, phase, r"non-finite value nan in step \d+, element \d+")
    for scheme, phase in (("zen", "push"), ("zen", "pull"), ("hc", "fold")):
        out = run_hostile(scheme, phase, with_nan)
        assert_named(out, phase, r"non-finite value nan in key \d+")
