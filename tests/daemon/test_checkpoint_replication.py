"""Replicating a checkpoint step across the nodes (zend/daemon/checkpoint_replication.py) and recovering a node's
checkpoints from its peers' copies (zend/daemon/checkpoint_recovery.py): the offers and their strict decoding,
the pure decisions, and the rounds over the in-process communicator (ranks as threads)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from tests.helpers import run_all
from zend.core.codec import PeerMessageError
from zend.core.comm import CommAborted, CommError, Communicator
from zend.daemon import checkpoint_replication
from zend.daemon.checkpoint_placement import held_by, replica_peers
from zend.daemon.checkpoint_recovery import CensusOffer, CensusPlan, JobHolding, Recovered, plan, run_census
from zend.daemon.checkpoint_replication import CheckpointIncomplete, Offer, Replicated, check_offers, replicate
from zend.transport.inproc import InProcessCluster

pytestmark = pytest.mark.inprocess

PREFIX = "0123456789ab/4294967296/7/1/"
STEP = 7
CHUNK = 16  # CHUNK_BYTES for these tests: objects of a few chunks stay tiny


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_replication, "CHUNK_BYTES", CHUNK)


def blob(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Recording(Communicator):
    """A rank's communicator that records what it sends: (dst, tag, bytes); optionally rewrites a payload."""

    def __init__(self, inner: Communicator, rewrite: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None):
        self.inner, self.rewrite = inner, rewrite
        self.rank, self.world_size = inner.rank, inner.world_size
        self.sent: list[tuple[int, str, int]] = []

    def send(self, dst: int, tag: str, payload: torch.Tensor) -> None:
        if self.rewrite is not None:
            payload = self.rewrite(dst, tag, payload)
        self.sent.append((dst, tag, payload.numel()))
        self.inner.send(dst, tag, payload)

    def recv(self, src: int, tag: str, timeout_s: float | None = None) -> torch.Tensor:
        return self.inner.recv(src, tag, timeout_s)

    def abort(self, prefix: str, reason: str, code: str = "ABORTED") -> None:
        self.inner.abort(prefix, reason, code)

    def data_sent(self) -> list[tuple[int, int]]:
        return [(dst, n) for dst, tag, n in self.sent if "/data/" in tag]


def outcomes(cluster: InProcessCluster, body: Callable[[int, Communicator], Any], timeout_s: float = 60) -> list[Any]:
    """body(rank, comm) on every rank; each rank's result or exception."""

    def caught(rank: int, comm: Communicator) -> Any:
        try:
            return body(rank, comm)
        except Exception as exc:
            return exc

    return cluster.run(caught, timeout_s=timeout_s)


# ====================================================================== offers


def framed(head: bytes, flag: int = 0, rest: bytes = b"") -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<Q", len(head)) + head + bytes([flag]) + rest), dtype=torch.uint8)


def header(**fields: Any) -> bytes:
    base: dict[str, Any] = {"world_size": 4, "ranks": [0, 1], "objects": [["a", 3]]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_an_offer_round_trips_with_its_metadata() -> None:
    meta = blob(37, 1)
    offer = Offer(8, (3, 0, 5), {"model.w/0": 100, "opt/state": 0, "ünï cödé": 5}, meta)
    payload = offer.encode()
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    back = Offer.decode(payload, 2, 0)
    assert (back.world_size, back.ranks, back.objects) == (8, (3, 0, 5), offer.objects)
    assert back.metadata is not None and torch.equal(back.metadata, meta)
    payload.fill_(0)  # the decoded metadata is its own copy
    assert torch.equal(back.metadata, meta)


def test_an_offer_round_trips_without_metadata() -> None:
    offer = Offer(1, (), {}, None)
    back = Offer.decode(offer.encode(), 2, 0)
    assert (back.world_size, back.ranks, back.objects, back.metadata) == (1, (), {}, None)
    back = Offer.decode(Offer(2, (1,), {"k": 9}, torch.empty(0, dtype=torch.uint8)).encode(), 1, 0)
    assert back.metadata is not None and back.metadata.numel() == 0  # an empty metadata is still a metadata


GOOD = Offer(4, (0, 1), {"a": 3}, None).encode()
GARBAGE: list[tuple[str, torch.Tensor, str]] = [
    ("empty", torch.empty(0, dtype=torch.uint8), "0 bytes"),
    ("shorter than the header's length", GOOD[:8], "8 bytes"),
    ("truncated header", GOOD[:20], "in a message of 20"),
    ("no flag byte", GOOD[:-1], f"in a message of {GOOD.numel() - 1}"),
    ("not JSON", framed(b"{world_size: 4"), "header is not JSON"),
    ("not UTF-8", framed(b"\xff\xfe\xfd"), "header is not JSON"),
    ("a list, not an object", framed(b"[4, [0], []]"), "header fields are not world_size, ranks, objects"),
    ("a field missing", framed(header(objects=...)), "header fields"),
    ("a field too many", framed(header(extra=1)), "header fields"),
    ("world size 0", framed(header(world_size=0, ranks=[])), "world_size 0"),
    ("world size a string", framed(header(world_size="4")), "world_size '4'"),
    ("world size a bool", framed(header(world_size=True, ranks=[0])), "world_size True"),
    ("world size too big", framed(header(world_size=(1 << 20) + 1)), f"world_size {(1 << 20) + 1}"),
    ("a rank at the world size", framed(header(ranks=[0, 4])), "ranks [0, 4]"),
    ("a negative rank", framed(header(ranks=[-1])), "ranks [-1]"),
    ("a rank twice", framed(header(ranks=[1, 1])), "ranks [1, 1]"),
    ("ranks not a list", framed(header(ranks="01")), "ranks 01"),
    ("a negative length", framed(header(objects=[["a", -1]])), "objects are not [key, length] pairs"),
    ("a float length", framed(header(objects=[["a", 1.5]])), "objects are not [key, length] pairs"),
    ("an empty key", framed(header(objects=[["", 1]])), "objects are not [key, length] pairs"),
    ("a key not a string", framed(header(objects=[[1, 1]])), "objects are not [key, length] pairs"),
    ("a pair of three", framed(header(objects=[["a", 1, 2]])), "objects are not [key, length] pairs"),
    ("objects a mapping", framed(header(objects={"a": 1})), "objects are not [key, length] pairs"),
    ("a key twice", framed(header(objects=[["a", 1], ["a", 2]])), "an object key appears twice"),
    ("flag 2", framed(header(), flag=2), "metadata flag 2"),
    ("bytes after no metadata", framed(header(), flag=0, rest=b"xyz"), "metadata flag 0 with 3 bytes after it"),
]


@pytest.mark.parametrize(("payload", "why"), [(p, w) for _, p, w in GARBAGE], ids=[i for i, _, _ in GARBAGE])
def test_a_bad_offer_is_refused_naming_the_sender(payload: torch.Tensor, why: str) -> None:
    with pytest.raises(PeerMessageError) as info:
        Offer.decode(payload, 5, 1)
    e = info.value
    assert (e.src, e.dst, e.phase) == (5, 1, "checkpoint offer")
    assert str(e).startswith("rank 5 sent rank 1 a bad checkpoint offer message: ")
    assert why in e.reason, (why, e.reason)


def test_a_good_framed_offer_decodes() -> None:  # the framing the garbage cases bend is the real one
    back = Offer.decode(framed(header(), flag=1, rest=b"meta"), 5, 1)
    assert (back.world_size, back.ranks, back.objects) == (4, (0, 1), {"a": 3})
    assert back.metadata is not None and bytes(back.metadata.tolist()) == b"meta"


def offers_of(*nodes: tuple[Sequence[int], bool], world: int = 4) -> dict[int, Offer]:
    """Node i's offer: the trainer ranks it wrote and whether it has the metadata."""
    return {i: Offer(world, tuple(ranks), {f"n{i}": 1}, torch.ones(2, dtype=torch.uint8) if meta else None)
            for i, (ranks, meta) in enumerate(nodes)}


def test_offers_that_make_one_checkpoint_pass() -> None:
    assert check_offers(offers_of(([0, 1], True), ([2], False), ([3], False)), STEP) is None
    assert check_offers(offers_of(([0], True), world=1), STEP) is None


@pytest.mark.parametrize(("offers", "why"), [
    (offers_of(([0, 1], True), ([2], False)), "checkpoint step 7: trainer ranks [3] wrote nothing"),
    (offers_of(([0], True), ([], False)), "trainer ranks [1, 2, 3] wrote nothing"),
    (offers_of(([0, 1], True), ([2, 3], False), ([1], False)), "trainer rank 1 wrote on nodes 0 and 2"),
    (offers_of(([0, 1], False), ([2, 3], False)), "metadata from 0 nodes ([]), not one"),
    (offers_of(([0, 1], True), ([2, 3], True)), "metadata from 2 nodes ([0, 1]), not one"),
    ({0: Offer(4, (0, 1, 2, 3), {}, torch.ones(1, dtype=torch.uint8)), 1: Offer(8, (4, 5, 6, 7), {}, None)},
     "nodes disagree on the trainers' world size ([4, 8])"),
], ids=["a rank missing", "three missing", "a rank on two nodes", "no metadata", "two metadata", "two worlds"])
def test_offers_that_do_not_make_one_checkpoint_say_why(offers: dict[int, Offer], why: str) -> None:
    got = check_offers(offers, STEP)
    assert got is not None and why in got, got


# ====================================================================== replicate


def scenario(n: int) -> tuple[list[Offer], list[dict[str, torch.Tensor]], torch.Tensor]:
    """Node r wrote trainer ranks 2r and 2r+1: a big object of several chunks (not a multiple of CHUNK), a small
    one, an empty one; nodes 0 and 1 both hold "shared"; the metadata is on the last node."""
    meta = blob(29, 1000)
    offers, objects = [], []
    for r in range(n):
        mine = {f"w{r}/big": blob(3 * CHUNK + 5 + r, r), f"w{r}/small": blob(r + 1, 100 + r),
                f"w{r}/empty": torch.empty(0, dtype=torch.uint8)}
        if r < 2:
            mine["shared"] = blob(6, 200)  # the same item on both (as a replicated DCP item would be)
        objects.append(mine)
        offers.append(Offer(2 * n, (2 * r, 2 * r + 1), {k: v.numel() for k, v in mine.items()},
                            meta.clone() if r == n - 1 else None))
    return offers, objects, meta


@pytest.mark.parametrize(("n", "replicas"), [(3, 1), (4, 1), (5, 1), (3, 2), (2, 1), (3, 0)])
def test_replicate_gives_each_holder_exactly_the_objects_it_lacks(n: int, replicas: int) -> None:
    offers, objects, meta = scenario(n)
    cluster = InProcessCluster(n)
    comms = [Recording(cluster.communicator(r)) for r in range(n)]
    paced = [0] * n

    def body(rank: int, _: Communicator) -> Replicated:
        def pace() -> None:
            paced[rank] += 1

        return replicate(comms[rank], PREFIX, STEP, offers[rank], objects[rank], replicas, 10.0, pace)

    results = cluster.run(body, timeout_s=60)
    for r, done in enumerate(results):
        assert isinstance(done, Replicated)
        assert torch.equal(done.metadata, meta), r  # every node keeps the metadata
        assert done.holders == (r, *replica_peers(r, n, replicas))
        assert done.held_for == held_by(r, n, replicas)
        assert sorted(done.offers) == list(range(n))
        assert all(done.offers[j].objects == offers[j].objects for j in range(n))
        expected = {k: v for j in held_by(r, n, replicas) for k, v in objects[j].items() if k not in objects[r]}
        assert sorted(done.objects) == sorted(expected), r
        for k, v in expected.items():
            assert torch.equal(done.objects[k], v), (r, k)
        # what it sent: every non-empty object its holders lack, in chunks of at most CHUNK bytes
        want = sorted((p, n_) for p in replica_peers(r, n, replicas) for k, v in objects[r].items()
                      if k not in objects[p] for n_ in chunk_sizes(v.numel()))
        assert sorted(comms[r].data_sent()) == want, r
        assert paced[r] == len(want)  # held back before every chunk
    if replicas >= 1:  # nodes 0 and 1 hold each other's objects; both have "shared": neither sends it
        assert "shared" not in results[1].objects and "shared" not in results[0].objects
        assert all(s <= CHUNK for c in comms for _, s in c.data_sent())
        assert sum(s == CHUNK for _, s in comms[0].data_sent()) >= 3  # the big object went in pieces
    assert cluster.mailbox_messages() == 0  # nothing left behind


def chunk_sizes(length: int) -> list[int]:
    return [min(CHUNK, length - a) for a in range(0, length, CHUNK)]


def test_the_objects_arrive_split_into_chunks() -> None:
    offers, objects, _ = scenario(3)
    cluster = InProcessCluster(3)
    comms = [Recording(cluster.communicator(r)) for r in range(3)]
    cluster.run(lambda r, _: replicate(comms[r], PREFIX, STEP, offers[r], objects[r], 1, 10.0), timeout_s=60)
    big = objects[0]["w0/big"].numel()
    assert big > 3 * CHUNK
    # node 0's objects go to node 1 (a ring of 0, 1, 2): the big one in ceil(big / CHUNK) messages, then the small
    assert comms[0].data_sent() == [(1, s) for s in [*chunk_sizes(big), 1]]
    assert len(chunk_sizes(big)) == math.ceil(big / CHUNK) == 4


def test_what_a_holder_receives_lands_in_the_room_allocate_gives() -> None:
    offers, objects, _ = scenario(3)
    cluster = InProcessCluster(3)
    asked: list[list[tuple[str, int]]] = [[] for _ in range(3)]
    arenas = [torch.zeros(1024, dtype=torch.uint8) for _ in range(3)]  # a segment per node

    def allocate_of(rank: int) -> Callable[[Sequence[tuple[str, int]]], dict[str, torch.Tensor]]:
        def allocate(lengths: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
            asked[rank].extend(lengths)
            room, at = {}, 0
            for key, n in lengths:
                room[key] = arenas[rank][at:at + n]
                at += n
            return room

        return allocate

    results = cluster.run(lambda r, c: replicate(c, PREFIX, STEP, offers[r], objects[r], 1, 10.0,
                                                 allocate=allocate_of(r)), timeout_s=60)
    for r, done in enumerate(results):
        source = held_by(r, 3, 1)[0]  # a ring of 0, 1, 2: node r holds node r - 1's objects
        lacked = {k: v for k, v in objects[source].items() if k not in objects[r]}
        assert sorted(asked[r]) == sorted((k, v.numel()) for k, v in lacked.items())
        assert sorted(done.objects) == sorted(lacked)
        for key, v in lacked.items():
            got = done.objects[key]
            assert torch.equal(got, v), (r, key)
            if v.numel():
                assert got.untyped_storage().data_ptr() == arenas[r].untyped_storage().data_ptr()  # no copy after


def expect_every_rank_failed(results: list[Any], *words: str) -> None:
    for r, out in enumerate(results):
        assert isinstance(out, Exception), f"rank {r} completed: {out!r}"
        assert isinstance(out, (CommError, PeerMessageError, CheckpointIncomplete)), (r, out)
        for w in words:
            assert w in str(out), (r, w, str(out))


def test_an_offer_missing_a_trainer_rank_fails_the_step_on_every_rank() -> None:
    offers, objects, _ = scenario(3)
    offers[2] = Offer(6, (4,), offers[2].objects, offers[2].metadata)  # trainer rank 5 wrote nothing
    cluster = InProcessCluster(3)
    results = outcomes(cluster, lambda r, c: replicate(c, PREFIX, STEP, offers[r], objects[r], 1, 10.0))
    expect_every_rank_failed(results, "trainer ranks [5] wrote nothing")
    assert any(isinstance(out, CheckpointIncomplete) for out in results)
    assert cluster.mailbox_messages() == 0


def test_two_metadata_fail_the_step_on_every_rank() -> None:
    offers, objects, meta = scenario(3)
    offers[0] = Offer(6, offers[0].ranks, offers[0].objects, meta)
    cluster = InProcessCluster(3)
    results = outcomes(cluster, lambda r, c: replicate(c, PREFIX, STEP, offers[r], objects[r], 1, 10.0))
    expect_every_rank_failed(results, "metadata from 2 nodes")


def test_a_node_that_never_takes_part_fails_the_step_on_the_others() -> None:
    offers, objects, _ = scenario(3)
    cluster = InProcessCluster(3)
    bodies = [lambda r=r: replicate(cluster.communicator(r), PREFIX, STEP, offers[r], objects[r], 1, 0.3)
              for r in range(2)]  # node 2 is not there
    results = run_all(bodies, timeout_s=30)
    expect_every_rank_failed(results)
    assert any("no message from rank 2" in str(out) for out in results), results
    assert cluster.voided(PREFIX + "ack/0") is not None  # the step's tags are void everywhere


def test_a_failure_while_sending_data_fails_the_step_on_every_rank() -> None:
    offers, objects, _ = scenario(3)
    cluster = InProcessCluster(3)

    def pace_of(rank: int) -> Callable[[], None]:
        def pace() -> None:
            if rank == 0:
                raise RuntimeError("node 0 is shutting down")

        return pace

    results = outcomes(cluster, lambda r, c: replicate(c, PREFIX, STEP, offers[r], objects[r], 1, 10.0, pace_of(r)))
    assert isinstance(results[0], RuntimeError)
    for r in (1, 2):
        assert isinstance(results[r], CommAborted), (r, results[r])
        assert "node 0 is shutting down" in str(results[r])
    assert cluster.mailbox_messages() == 0


def test_a_chunk_of_the_wrong_size_fails_the_step_on_every_rank_naming_the_sender() -> None:
    offers, objects, _ = scenario(3)
    objects[0] = {**objects[0], "w0/big": objects[0]["w0/big"][:-7]}  # shorter than node 0 offered
    cluster = InProcessCluster(3)
    results = outcomes(cluster, lambda r, c: replicate(c, PREFIX, STEP, offers[r], objects[r], 1, 10.0))
    expect_every_rank_failed(results)
    bad = results[1]  # node 1 holds node 0's objects
    assert isinstance(bad, PeerMessageError), bad
    assert (bad.src, bad.dst, bad.phase) == (0, 1, "checkpoint data")
    assert "'w0/big'" in bad.reason


def test_a_garbled_offer_fails_the_step_on_every_rank_naming_the_sender() -> None:
    offers, objects, _ = scenario(3)
    cluster = InProcessCluster(3)

    def garble(dst: int, tag: str, payload: torch.Tensor) -> torch.Tensor:
        return payload[:5] if tag.endswith("offer/0") else payload

    comms: list[Communicator] = [cluster.communicator(0), cluster.communicator(1),
                                 Recording(cluster.communicator(2), garble)]
    results = outcomes(cluster, lambda r, _: replicate(comms[r], PREFIX, STEP, offers[r], objects[r], 1, 10.0))
    expect_every_rank_failed(results, "rank 2 sent rank")
    assert any(isinstance(out, PeerMessageError) and out.src == 2 for out in results)


# ====================================================================== census: offers and plan


def holding(step: int, nodes: Sequence[int], writers: Sequence[int], copies: Mapping[int, Mapping[str, int]],
            metadata: int = 4) -> JobHolding:
    return JobHolding(step, tuple(nodes), tuple(writers), {n: dict(keys) for n, keys in copies.items()}, metadata)


def keys_of(node: int) -> dict[str, int]:
    return {f"n{node}/a": 10 + node, f"n{node}/b": 3}


def test_a_census_offer_round_trips() -> None:
    offer = CensusOffer(11, {"job a": holding(7, [10, 11, 12], [10, 11], {11: keys_of(11), 10: keys_of(10)}),
                             "b": holding(0, [11], [], {}, metadata=1)})
    back = CensusOffer.decode(offer.encode(), 1, 0)
    assert back == offer
    assert CensusOffer.decode(CensusOffer(3, {}).encode(), 1, 0) == CensusOffer(3, {})


def census_payload(body: Any) -> torch.Tensor:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def census_job(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"step": 3, "nodes": [0, 1], "writers": [0], "copies": {"0": [["k", 2]]}, "metadata": 4}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not ...}


@pytest.mark.parametrize("body", [
    b"", b"not json", b"\xff\xfe", [], {"jobs": {}}, {"node": 1}, {"node": 1, "jobs": []},
    {"node": 1, "jobs": {"j": census_job(step=-1)}},
    {"node": 1, "jobs": {"j": census_job(metadata=0)}},
    {"node": 1, "jobs": {"j": census_job(copies={"0": [["k", -2]]})}},
    {"node": 1, "jobs": {"j": census_job(copies={"0": [["k", 2], ["k", 3]]})}},
    {"node": 1, "jobs": {"j": census_job(copies={"zero": [["k", 2]]})}},
    {"node": 1, "jobs": {"j": census_job(copies={"0": [["k"]]})}},
    {"node": 1, "jobs": {"j": census_job(nodes=None)}},
    {"node": 1, "jobs": {"j": census_job(step=...)}},
], ids=["empty", "not JSON", "not UTF-8", "a list", "no node", "no jobs", "jobs a list", "a negative step",
        "no metadata", "a negative length", "a key twice", "a node not a number", "a pair of one", "nodes null",
        "no step"])
def test_a_bad_census_offer_is_refused_naming_the_sender(body: Any) -> None:
    with pytest.raises(PeerMessageError) as info:
        CensusOffer.decode(census_payload(body), 4, 2)
    assert (info.value.src, info.value.dst, info.value.phase) == (4, 2, "checkpoint census")
    assert str(info.value).startswith("rank 4 sent rank 2 a bad checkpoint census message: not a census offer")


def test_the_plan_restores_a_node_that_holds_nothing_from_the_lowest_ranked_holder() -> None:
    nodes = [20, 21, 22, 23]  # --rank of generation ranks 0..3
    every = {n: keys_of(n) for n in nodes}
    offers = {
        0: CensusOffer(20, {}),  # restarted: holds nothing
        1: CensusOffer(21, {"j": holding(7, nodes, nodes, {21: every[21], 22: every[22]})}),
        2: CensusOffer(22, {"j": holding(7, nodes, nodes, {22: every[22], 23: every[23], 20: every[20]}, 5)}),
        3: CensusOffer(23, {"j": holding(7, nodes, nodes, {23: every[23], 20: every[20], 21: every[21]})}),
    }
    decided = plan(offers)
    assert decided.lost == {}
    (t,) = decided.transfers
    assert (t.job, t.step, t.sender, t.receiver) == ("j", 7, 2, 0)  # not rank 1, the first holding the step
    assert t.keys == [("", 5), ("n20/a", 30), ("n20/b", 3)]  # the metadata first, then sorted
    assert t.holding is offers[2].jobs["j"]
    reordered = plan(dict(reversed(offers.items())))  # every node decides the same, whatever the order
    assert [(x.job, x.sender, x.receiver, x.keys) for x in reordered.transfers] == [(t.job, 2, 0, t.keys)]


def test_the_plan_sends_by_generation_rank_not_by_node_rank() -> None:
    nodes = [20, 21, 22]
    offers = {
        0: CensusOffer(22, {}),
        1: CensusOffer(21, {"j": holding(3, nodes, nodes, {21: keys_of(21), 22: keys_of(22), 20: keys_of(20)})}),
        2: CensusOffer(20, {"j": holding(3, nodes, nodes, {20: keys_of(20), 22: keys_of(22), 21: keys_of(21)})}),
    }
    (t,) = plan(offers).transfers
    assert (t.sender, t.receiver) == (1, 0)  # the lowest generation rank, though node 20 < node 21
    assert t.keys == [("", 4), *sorted(keys_of(22).items())]


def test_the_plan_marks_a_step_lost_naming_the_writers_no_survivor_holds() -> None:
    nodes = [0, 1, 2, 3]
    offers = {
        0: CensusOffer(0, {"ok": holding(2, [0, 1], [0, 1], {0: keys_of(0), 1: keys_of(1)})}),
        1: CensusOffer(1, {"ok": holding(2, [0, 1], [0, 1], {1: keys_of(1), 0: keys_of(0)})}),
        2: CensusOffer(2, {"j": holding(5, nodes, [0, 1, 2], {2: keys_of(2)})}),  # 0's and 1's objects: gone
        3: CensusOffer(3, {"j": holding(5, nodes, [0, 1, 2], {2: keys_of(2)})}),
    }
    decided = plan(offers)
    assert set(decided.lost) == {"j"}
    step, why = decided.lost["j"]
    assert step == 5
    assert why == ("checkpoint step 5 of job 'j' is lost: the objects of node(s) [0, 1] were on no surviving node "
                   "(survivors holding the step: [2, 3]); restore from persistent storage")
    assert decided.transfers == []  # nothing of a lost step moves, and job "ok" is held where it must be


def test_the_plan_brings_the_newest_step_to_a_node_with_an_older_one_and_metadata_to_a_node_that_wrote_nothing(
        ) -> None:
    gen = [0, 1, 2, 3, 7]  # node 7 wrote step 4 but is not in this generation; node 3 wrote nothing
    writers = [0, 1, 2, 7]
    offers = {
        0: CensusOffer(0, {"j": holding(3, [0, 1, 2], [0, 1, 2], {0: keys_of(0)})}),  # an older step
        1: CensusOffer(1, {"j": holding(4, gen, writers, {1: keys_of(1), 0: keys_of(0), 7: keys_of(7)}, 6)}),
        2: CensusOffer(2, {"j": holding(4, gen, writers, {2: keys_of(2), 0: keys_of(0), 1: keys_of(1)})}),
        3: CensusOffer(3, {}),
    }
    decided = plan(offers)
    assert decided.lost == {}
    got = {(t.receiver, t.sender): t.keys for t in decided.transfers}
    assert got == {(0, 1): [("", 6), *sorted(keys_of(0).items())], (3, 1): [("", 6)]}
    assert all(t.step == 4 for t in decided.transfers)


def test_the_plan_is_empty_when_every_node_holds_the_newest_step() -> None:
    assert plan({}) == CensusPlan()
    h = holding(1, [0, 1], [0, 1], {0: keys_of(0), 1: keys_of(1)})
    assert plan({0: CensusOffer(0, {"j": h}), 1: CensusOffer(1, {"j": h})}) == CensusPlan()


# ====================================================================== census: the rounds


def test_run_census_moves_every_byte_to_the_node_that_lost_them() -> None:
    """Nodes 10, 11, 12 (generation ranks 0, 1, 2); node 10 restarted. Job "a" step 7: every node held every
    node's objects, so node 10 gets its own from rank 1. Job "b" step 3: node 10's objects only on node 12 (rank
    2). Job "c" step 2: node 10's objects were only on node 10: lost."""
    nodes = (10, 11, 12)
    sizes = {"big": 2 * CHUNK + 3, "edge": CHUNK, "tiny": 1, "void": 0}
    original = {(job, n): {f"{job}{n}/{k}": blob(size, 1000 * i + 10 * n + s)
                           for s, (k, size) in enumerate(sizes.items())}
                for i, job in enumerate("abc") for n in nodes}
    meta = {job: blob(11 + i, 500 + i) for i, job in enumerate("abc")}
    held_copies = {  # (job, holder) -> nodes whose objects it holds; node 10 holds nothing
        ("a", 11): nodes, ("a", 12): nodes,
        ("b", 11): (11,), ("b", 12): (12, 10),
        ("c", 11): (11, 12), ("c", 12): (12, 11),
    }
    steps = {"a": 7, "b": 3, "c": 2}
    stores: dict[int, dict[tuple[str, int], dict[str, torch.Tensor]]] = {n: {} for n in nodes}
    mine: list[CensusOffer] = []
    for n in nodes:
        jobs = {}
        for (job, holder), of in held_copies.items():
            if holder != n:
                continue
            objects = {"": meta[job].clone(), **{k: v.clone() for m in of for k, v in original[(job, m)].items()}}
            stores[n][(job, steps[job])] = objects
            jobs[job] = JobHolding(steps[job], nodes, nodes,
                                   {m: {k: v.numel() for k, v in original[(job, m)].items()} for m in of},
                                   meta[job].numel())
        mine.append(CensusOffer(n, jobs))
    cluster = InProcessCluster(3)
    comms = [Recording(cluster.communicator(r)) for r in range(3)]

    def body(rank: int, _: Communicator) -> tuple[list[Recovered], CensusPlan]:
        def read(job: str, step: int, key: str) -> torch.Tensor:
            return stores[nodes[rank]][(job, step)][key]

        return run_census(comms[rank], "census/4294967297/5/0/", mine[rank], read, 10.0)

    results = cluster.run(body, timeout_s=60)
    (recovered0, plan0), (recovered1, plan1), (recovered2, plan2) = results
    assert plan0 == plan1 == plan2  # every node decided the same
    assert set(plan0.lost) == {"c"} and "node(s) [10]" in plan0.lost["c"][1]
    assert recovered1 == [] and recovered2 == []
    assert [(r.job, r.step) for r in recovered0] == [("a", 7), ("b", 3)]
    for r in recovered0:
        want = {"": meta[r.job], **original[(r.job, 10)]}
        assert sorted(r.objects) == sorted(want), r.job
        for k, v in want.items():
            assert torch.equal(r.objects[k], v), (r.job, k)
        assert r.holding == mine[{"a": 1, "b": 2}[r.job]].jobs[r.job]
    # the bytes moved once, from the lowest-ranked holder, in chunks of at most CHUNK; an empty object sends nothing
    per_transfer = sorted(n for k in ["", *sizes] for n in chunk_sizes(meta["a"].numel() if k == "" else sizes[k]))
    assert sorted(n for _, n in comms[1].data_sent()) == per_transfer
    assert sorted(n for _, n in comms[2].data_sent()) == sorted(
        n for k in ["", *sizes] for n in chunk_sizes(meta["b"].numel() if k == "" else sizes[k]))
    assert comms[0].data_sent() == []
    assert {dst for c in comms for dst, _ in c.data_sent()} == {0}
    assert cluster.mailbox_messages() == 0


def test_a_census_with_a_node_missing_fails_on_the_others() -> None:
    cluster = InProcessCluster(3)

    def read(job: str, step: int, key: str) -> torch.Tensor:
        raise AssertionError("nothing is read")

    bodies = [lambda r=r: run_census(cluster.communicator(r), "census/4294967297/6/0/", CensusOffer(r, {}), read, 0.3)
              for r in range(2)]
    results = run_all(bodies, timeout_s=30)
    for r, out in enumerate(results):
        assert isinstance(out, CommError), (r, out)


def test_run_census_lands_the_objects_in_the_room_allocate_gives_and_the_metadata_apart() -> None:
    objects = {"n0/a": blob(CHUNK + 2, 1), "n0/b": blob(5, 2)}
    meta = blob(9, 3)
    held = {"": meta, **objects}
    offers = [CensusOffer(0, {}),
              CensusOffer(1, {"j": JobHolding(4, (0, 1), (0,), {0: {k: v.numel() for k, v in objects.items()}}, 9)})]
    arena = torch.zeros(256, dtype=torch.uint8)
    asked: list[tuple[str, list[tuple[str, int]]]] = []

    def allocate(job: str, lengths: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
        asked.append((job, list(lengths)))
        room, at = {}, 0
        for key, n in lengths:
            room[key] = arena[at:at + n]
            at += n
        return room

    cluster = InProcessCluster(2)
    results = cluster.run(lambda r, c: run_census(c, "census/4294967297/9/0/", offers[r], lambda j, s, k: held[k],
                                                  10.0, allocate), timeout_s=60)
    (recovered, _), (none, _) = results
    assert none == []
    assert asked == [("j", [("n0/a", CHUNK + 2), ("n0/b", 5)])]  # the receiver's only; never the metadata
    (r,) = recovered
    assert (r.job, r.step) == ("j", 4)
    for key, v in held.items():
        assert torch.equal(r.objects[key], v), key
    for key in objects:
        assert r.objects[key].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert r.objects[""].untyped_storage().data_ptr() != arena.untyped_storage().data_ptr()
