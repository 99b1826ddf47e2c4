"""A node that lost its checkpoints (its daemon restarted, or it replaces a lost node under the same --rank)
gets them back from its peers' copies, when a generation forms (GEMINI's recovery from remote CPU memory).

Every node of a new generation runs one *census* on the data plane (tags `census/CENSUS_TENSOR/generation/
0/phase/round`, judged like a step's: the generation only moves forward), in three rounds:
1. *offer* (all-to-all): for each job, the newest complete step this node holds, the nodes of that step's
   generation, those whose trainers wrote objects, and the keys and lengths of every node's objects it
   holds a whole copy of (its own too), and its metadata's length.
2. *data*: for each job's newest step k anywhere, every node of k's generation that lacks k gets its own
   objects and the metadata from the lowest-ranked node holding a copy; chunks as in replication.
3. *ack* (all-to-all).
A writer of step k whose objects no survivor holds makes step k lost on every node, with the lost nodes
named (a trainer is then told to restore from persistent storage). Pure decisions (`plan`) apart from the
rounds (`run_census`), written against a Communicator.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from zend.core.codec import PeerMessageError
from zend.core.comm import Communicator
from zend.daemon.checkpoint_replication import MAX_OFFER_BYTES, acknowledge, fresh, move_objects

CENSUS_KEY = "census"  # the tags' job key (a job's key is 12 hex digits: never this)
CENSUS_TENSOR = (1 << 32) + 1


@dataclass(frozen=True)
class JobHolding:
    """What one node holds of a job's newest complete checkpoint."""

    step: int
    nodes: tuple[int, ...]  # the step's generation, by --rank
    writers: tuple[int, ...]  # nodes whose trainers wrote objects
    copies: dict[int, dict[str, int]]  # node (--rank) -> its objects' keys and lengths, held whole here
    metadata: int  # the metadata's length

    def to_json(self) -> dict[str, object]:
        return {"step": self.step, "nodes": list(self.nodes), "writers": list(self.writers),
                "copies": {str(n): list(keys.items()) for n, keys in self.copies.items()}, "metadata": self.metadata}


@dataclass(frozen=True)
class CensusOffer:
    node: int  # this node's --rank
    jobs: dict[str, JobHolding]

    def encode(self) -> torch.Tensor:
        body = json.dumps({"node": self.node, "jobs": {j: h.to_json() for j, h in self.jobs.items()}}).encode()
        return torch.frombuffer(bytearray(body), dtype=torch.uint8)

    @staticmethod
    def decode(payload: torch.Tensor, src: int, dst: int) -> CensusOffer:
        def bad(why: str) -> PeerMessageError:
            return PeerMessageError(src, dst, "checkpoint census", why)

        if payload.numel() > MAX_OFFER_BYTES:
            raise bad(f"{payload.numel()} bytes")
        try:
            body = json.loads(bytes(payload.reshape(-1).numpy()))
            jobs = {}
            for job, h in body["jobs"].items():
                copies = {}
                for n, keys in h["copies"].items():
                    table = {str(k): int(v) for k, v in keys}
                    if any(v < 0 for v in table.values()) or len(table) != len(keys):
                        raise ValueError(f"copies of node {n}: negative lengths or a key twice")
                    copies[int(n)] = table
                jobs[str(job)] = JobHolding(int(h["step"]), tuple(map(int, h["nodes"])), tuple(map(int, h["writers"])),
                                            copies, int(h["metadata"]))
                if jobs[str(job)].step < 0 or jobs[str(job)].metadata < 1:
                    raise ValueError(f"job {str(job)[:40]!r}: step {h['step']}, metadata {h['metadata']}")
            return CensusOffer(int(body["node"]), jobs)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
                RecursionError) as exc:
            raise bad(f"not a census offer ({str(exc)[:120]})") from None


@dataclass
class Transfer:
    """Node `sender` gives node `receiver` (both ranks in the generation) job `job`'s step `step`:
    `keys` (sorted, the metadata "" first) of the lengths given."""

    job: str
    step: int
    sender: int
    receiver: int
    keys: list[tuple[str, int]]
    holding: JobHolding  # the sender's, for the receiver to record


@dataclass
class CensusPlan:
    transfers: list[Transfer] = field(default_factory=list)
    lost: dict[str, tuple[int, str]] = field(default_factory=dict)  # job -> (step, why it cannot be restored)


def plan(offers: Mapping[int, CensusOffer]) -> CensusPlan:
    """What moves where (the same answer on every node: it only reads the offers)."""
    out = CensusPlan()
    jobs = sorted({job for o in offers.values() for job in o.jobs})
    node_rank = {o.node: r for r, o in offers.items()}
    for job in jobs:
        step = max(o.jobs[job].step for o in offers.values() if job in o.jobs)
        survivors = sorted(r for r, o in offers.items() if job in o.jobs and o.jobs[job].step == step)
        first = offers[survivors[0]].jobs[job]
        held = {n: min((r for r in survivors if n in offers[r].jobs[job].copies), default=None) for n in first.nodes}
        lost = sorted(n for n in first.writers if held.get(n) is None)
        if lost:
            holders = sorted({offers[r].node for r in survivors})
            out.lost[job] = (step, f"checkpoint step {step} of job {job!r} is lost: the objects of node(s) {lost} "
                                   f"were on no surviving node (survivors holding the step: {holders}); restore "
                                   "from persistent storage")
            continue
        for n in first.nodes:
            receiver = node_rank.get(n)
            if receiver is None or receiver in survivors:
                continue  # not in this generation, or holds the step already
            sender = held.get(n)
            if sender is None:  # a node whose trainers wrote nothing: it only needs the metadata
                sender = survivors[0]
            holding = offers[sender].jobs[job]
            keys = [("", holding.metadata), *sorted(holding.copies.get(n, {}).items())]
            out.transfers.append(Transfer(job, step, sender, receiver, keys, holding))
    return out


@dataclass
class Recovered:
    job: str
    step: int
    objects: dict[str, torch.Tensor]  # the metadata under ""
    holding: JobHolding  # as the sender held it


def run_census(comm: Communicator, prefix: str, mine: CensusOffer, read: Callable[[str, int, str], torch.Tensor],
               timeout_s: float, allocate: Callable[[str, Sequence[tuple[str, int]]], dict[str, torch.Tensor]] =
               lambda job, lengths: fresh(lengths)) -> tuple[list[Recovered], CensusPlan]:
    """The module's three rounds for this node; `read(job, step, key)` gives an object it holds, `allocate`
    the room for each job's objects it receives (the metadata aside). Raises on failure, having aborted
    `prefix` everywhere."""
    me, n = comm.rank, comm.world_size
    others = [j for j in range(n) if j != me]
    try:
        got = comm.exchange([(j, prefix + "offer/0", mine.encode()) for j in others],
                            [(j, prefix + "offer/0") for j in others], timeout_s)
        offers = {me: mine, **{j: CensusOffer.decode(p, j, me) for j, p in zip(others, got, strict=True)}}
        decided = plan(offers)
        sends = [t for t in decided.transfers if t.sender == me]
        recvs = [t for t in decided.transfers if t.receiver == me]
        outgoing = [(t.receiver, read(t.job, t.step, key)) for t in sends for key, _ in t.keys]
        rooms = []
        for t in recvs:
            room = allocate(t.job, [(key, length) for key, length in t.keys if key])
            rooms.append({key: room[key] if key else torch.empty(length, dtype=torch.uint8) for key, length in t.keys})
        move_objects(comm, prefix, outgoing, [(t.sender, key, room[key]) for t, room in zip(recvs, rooms, strict=True)
                                              for key, _ in t.keys], timeout_s, "checkpoint census data")
        recovered = [Recovered(t.job, t.step, room, t.holding) for t, room in zip(recvs, rooms, strict=True)]
        acknowledge(comm, prefix, timeout_s)
    except BaseException as exc:
        comm.abort(prefix, f"checkpoint census failed on node rank {me}: {exc}")
        raise
    return recovered, decided
