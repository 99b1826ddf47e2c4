"""One checkpoint step made complete across the nodes: offers, replicas to the holders, acknowledgement.

Run by every node of the generation once its own part of step k is whole (checkpoints.py), on the data
plane with tags `job_key/CKPT_TENSOR/k/generation/phase/round` (so admission.py judges them like a
step's: a step at or below the last complete one is discarded), in three rounds:
1. *offer* (all-to-all): which trainer ranks this node wrote, its objects' keys and lengths, and the
   metadata if DCP's coordinator is here. Every node checks that each rank of the job was written on
   exactly one node and that there is one metadata, and keeps the metadata (every trainer reads it).
2. *data*: each node sends its holders (checkpoint_placement.replica_peers) the objects they lack, in
   chunks of CHUNK_BYTES, from a thread of its own while it receives what it holds for others; before
   every chunk `pace` may hold it back (gradient steps first).
3. *ack* (all-to-all, one byte): every node holds what it must. Only then is the step complete.
A failure anywhere aborts the step's tags on every node (Communicator.abort), so no node completes it
while another is still missing data; the ack round leaves one gap (a node that completes while a late
peer fails on the last ack), which a load closes by agreeing on a step complete on every node.
Written against a Communicator: no gRPC, no buffers, the same over the data plane and in-process.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from zend.core.codec import PeerMessageError
from zend.core.comm import Communicator
from zend.daemon import checkpoint_placement

CKPT_TENSOR = 1 << 32  # the tensor id of checkpoint tags: above every registered (uint32) tensor id
CHUNK_BYTES = 4 << 20
MAX_OFFER_BYTES = 512 << 20  # keys and lengths of every object plus the metadata
_HEAD = struct.Struct("<Q")


@dataclass(frozen=True)
class Offer:
    world_size: int
    ranks: tuple[int, ...]  # trainer ranks whose objects this node wrote
    objects: dict[str, int]  # its own objects: key -> length
    metadata: torch.Tensor | None  # DCP's metadata, on the coordinator's node

    def encode(self) -> torch.Tensor:
        head = json.dumps({"world_size": self.world_size, "ranks": list(self.ranks),
                           "objects": list(self.objects.items())}).encode()
        meta = self.metadata if self.metadata is not None else torch.empty(0, dtype=torch.uint8)
        flag = b"\x01" if self.metadata is not None else b"\x00"
        return torch.cat([torch.frombuffer(bytearray(_HEAD.pack(len(head)) + head + flag), dtype=torch.uint8),
                          meta.reshape(-1)])

    @staticmethod
    def decode(payload: torch.Tensor, src: int, dst: int) -> Offer:
        """A peer's offer, checked to the field (PeerMessageError naming what is wrong)."""
        def bad(why: str) -> PeerMessageError:
            return PeerMessageError(src, dst, "checkpoint offer", why)

        raw = payload.reshape(-1).to(torch.uint8)
        if raw.numel() < _HEAD.size + 1 or raw.numel() > MAX_OFFER_BYTES:
            raise bad(f"{raw.numel()} bytes")
        (n,) = _HEAD.unpack(bytes(raw[:_HEAD.size].tolist()))
        if n > raw.numel() - _HEAD.size - 1:
            raise bad(f"header of {n} bytes in a message of {raw.numel()}")
        try:
            head = json.loads(bytes(raw[_HEAD.size:_HEAD.size + n].numpy()))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise bad(f"header is not JSON ({exc})") from None
        flag = int(raw[_HEAD.size + n])
        rest = raw[_HEAD.size + n + 1:]
        if not isinstance(head, dict) or set(head) != {"world_size", "ranks", "objects"}:
            raise bad("header fields are not world_size, ranks, objects")
        world, ranks, objects = head["world_size"], head["ranks"], head["objects"]
        if not _count(world) or not 1 <= world <= 1 << 20:
            raise bad(f"world_size {world!r}")
        if not isinstance(ranks, list) or not all(_count(r) and r < world for r in ranks) \
                or len(set(ranks)) != len(ranks):
            raise bad(f"ranks {str(ranks)[:80]} (each in [0, {world}), once)")
        if not isinstance(objects, list) or not all(
                isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) and o[0] and _count(o[1])
                for o in objects):
            raise bad("objects are not [key, length] pairs")
        table = dict(objects)
        if len(table) != len(objects):
            raise bad("an object key appears twice")
        if flag not in (0, 1) or (flag == 0 and rest.numel()):
            raise bad(f"metadata flag {flag} with {rest.numel()} bytes after it")
        return Offer(world, tuple(ranks), table, rest.clone() if flag else None)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class Replicated:
    metadata: torch.Tensor  # the checkpoint's metadata (every node keeps it)
    objects: dict[str, torch.Tensor]  # the objects received as a holder of other nodes
    holders: tuple[int, ...]  # the ranks holding a copy of this node's objects, itself first
    offers: dict[int, Offer]  # every node's offer, by rank
    held_for: tuple[int, ...]  # the ranks whose objects this node now holds a copy of (itself aside)


def check_offers(offers: Mapping[int, Offer], step: int) -> str | None:
    """Why the nodes' offers do not make one whole checkpoint (None when they do)."""
    worlds = {o.world_size for o in offers.values()}
    if len(worlds) != 1:
        return f"checkpoint step {step}: nodes disagree on the trainers' world size ({sorted(worlds)})"
    (world,) = worlds
    seen: dict[int, int] = {}
    for node, o in sorted(offers.items()):
        for r in o.ranks:
            if r in seen:
                return f"checkpoint step {step}: trainer rank {r} wrote on nodes {seen[r]} and {node}"
            seen[r] = node
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        return f"checkpoint step {step}: trainer ranks {missing[:16]} wrote nothing"
    coordinators = [node for node, o in offers.items() if o.metadata is not None]
    if len(coordinators) != 1:
        return f"checkpoint step {step}: metadata from {len(coordinators)} nodes ({coordinators}), not one"
    return None


def _chunks(length: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + CHUNK_BYTES)) for a in range(0, length, CHUNK_BYTES)]


def move_objects(comm: Communicator, prefix: str, outgoing: Sequence[tuple[int, torch.Tensor]],
                 incoming: Sequence[tuple[int, str, torch.Tensor]], timeout_s: float, phase: str,
                 pace: Callable[[], None] = lambda: None) -> None:
    """A data round: each (destination, object) of `outgoing` sent in CHUNK_BYTES chunks, from a thread of its
    own (two nodes sending each other much would otherwise fill each other's mailboxes and wait forever),
    while each (source, key, room) of `incoming` is received into its room. Chunks are numbered per peer
    (`prefix`data/N), so both sides agree by keeping the same order; an empty object sends nothing. A chunk
    of the wrong size is a PeerMessageError of `phase`; a send's failure is raised here."""
    failure: list[BaseException] = []

    def send_all() -> None:
        try:
            seq: dict[int, int] = {}
            for dst, data in outgoing:
                flat = data.reshape(-1)
                for a, b in _chunks(flat.numel()):
                    pace()
                    comm.send(dst, f"{prefix}data/{seq.get(dst, 0)}", flat[a:b])
                    seq[dst] = seq.get(dst, 0) + 1
        except BaseException as exc:  # handed to the receiving thread
            failure.append(exc)

    sender = threading.Thread(target=send_all, name=f"zen-{phase.replace(' ', '-')}-send", daemon=True)
    sender.start()
    try:
        seq: dict[int, int] = {}
        for src, key, out in incoming:
            for a, b in _chunks(out.numel()):
                i = seq.get(src, 0)
                part = comm.recv(src, f"{prefix}data/{i}", timeout_s).reshape(-1)
                if part.numel() != b - a:
                    raise PeerMessageError(src, comm.rank, phase, f"chunk {i} of object {key[:60]!r} has "
                                                                  f"{part.numel()} bytes, {b - a} expected")
                out[a:b].copy_(part)
                seq[src] = i + 1
    finally:
        sender.join()
    if failure:
        raise failure[0]


def acknowledge(comm: Communicator, prefix: str, timeout_s: float) -> None:
    """The last round: a byte from every node to every other."""
    others = [j for j in range(comm.world_size) if j != comm.rank]
    token = torch.ones(1, dtype=torch.uint8)
    comm.exchange([(j, prefix + "ack/0", token) for j in others], [(j, prefix + "ack/0") for j in others], timeout_s)


Allocate = Callable[[Sequence[tuple[str, int]]], dict[str, torch.Tensor]]  # (key, length)s -> room for each


def fresh(lengths: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
    return {key: torch.empty(n, dtype=torch.uint8) for key, n in lengths}


def replicate(comm: Communicator, prefix: str, step: int, mine: Offer, objects: Mapping[str, torch.Tensor],
              replicas: int, timeout_s: float, pace: Callable[[], None] = lambda: None,
              allocate: Allocate = fresh) -> Replicated:
    """Rounds 1-3 of the module's docstring for this node; raises (CommError, PeerMessageError,
    CheckpointIncomplete) on failure, having aborted `prefix` everywhere. What it receives lands in the
    room `allocate` gives (the daemon's checkpoint segments)."""
    me, n = comm.rank, comm.world_size
    others = [j for j in range(n) if j != me]
    try:
        sent = mine.encode()
        got = comm.exchange([(j, prefix + "offer/0", sent) for j in others],
                            [(j, prefix + "offer/0") for j in others], timeout_s)
        offers = {me: mine, **{j: Offer.decode(p, j, me) for j, p in zip(others, got, strict=True)}}
        why = check_offers(offers, step)
        if why is not None:
            raise CheckpointIncomplete(why)
        metadata = next(o.metadata for o in offers.values() if o.metadata is not None)
        assert metadata is not None

        to_send = {p: sorted(k for k in mine.objects if k not in offers[p].objects)
                   for p in checkpoint_placement.replica_peers(me, n, replicas)}
        to_recv = {j: sorted(k for k in offers[j].objects if k not in mine.objects)
                   for j in checkpoint_placement.held_by(me, n, replicas)}
        room = allocate([(k, offers[j].objects[k]) for j, keys in to_recv.items() for k in keys])
        move_objects(comm, prefix, [(p, objects[k]) for p, keys in to_send.items() for k in keys],
                     [(j, k, room[k]) for j, keys in to_recv.items() for k in keys], timeout_s, "checkpoint data",
                     pace)
        received = {k: room[k] for keys in to_recv.values() for k in keys}
        acknowledge(comm, prefix, timeout_s)
    except BaseException as exc:
        comm.abort(prefix, f"checkpoint step {step} failed on node rank {me}: {exc}")
        raise
    holders = (me, *checkpoint_placement.replica_peers(me, n, replicas))
    return Replicated(metadata, received, holders, offers, checkpoint_placement.held_by(me, n, replicas))


class CheckpointIncomplete(RuntimeError):
    """The nodes' parts of a checkpoint step do not make one whole checkpoint."""
