"""The daemon's in-memory checkpoints: trainers' puts and reads through shared buffers, and the thread
that replicates each whole step (checkpoint_replication.py) over the data plane.

Bytes move only between a trainer's shared buffer and the store's memory (one copy each way); the gRPC
calls that ask for it carry keys, offsets and lengths. Replication runs on one thread, a step at a time
in the order steps became whole here (the same order on every node), its chunks held back while a
gradient step is in flight on this node (`busy`), at most PACE_WAIT_S per chunk, so that training
traffic goes first (GEMINI's interleaving, at the grain of whole steps).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zend.buffers.shared import SharedBuffer, SharedBufferError
from zend.core.comm import Communicator
from zend.daemon import errors as codes
from zend.daemon.checkpoint_recovery import CENSUS_KEY, CENSUS_TENSOR, CensusOffer, JobHolding, run_census
from zend.daemon.checkpoint_replication import CKPT_TENSOR, Offer, Replicated, replicate
from zend.daemon.checkpoints import METADATA_KEY, Checkpoint, CheckpointStore
from zend.daemon.errors import StepError
from zend.daemon.jobs import Session, job_key

log = logging.getLogger("zend.checkpoints")
PACE_WAIT_S = 0.05  # the longest a replica chunk waits for the node's gradient steps to finish
ALIGN = 64


class SegmentPool:
    """Segments of freed checkpoints that no trainer ever mapped, kept for the next ones: their pages stay
    mapped, so a save that fills one copies at memory speed rather than faulting in fresh zeroed pages
    (a checkpoint every iteration frees one of the same size every time). A segment once lent to a trainer
    is closed instead (a reader may still map it). At most MAX_SEGMENTS segments and `max_bytes`."""

    MAX_SEGMENTS = 8

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: list[SharedBuffer] = []
        self._lent: set[int] = set()  # id() of segments whose descriptor went to a trainer
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> SharedBuffer:
        """A segment of at least `nbytes` (a kept one of at most twice that, else a new one)."""
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.nbytes <= 2 * nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._free.remove(best)
                return best
        try:
            return SharedBuffer.create_sealable(nbytes, secrets.token_hex(8))
        except SharedBufferError as exc:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"checkpoint memory of {nbytes} bytes: {exc}") from None

    def lent(self, segment: SharedBuffer) -> None:
        with self._lock:
            self._lent.add(id(segment))

    def recycle(self, segment: SharedBuffer) -> None:
        with self._lock:
            keep = (id(segment) not in self._lent and not segment.closed and len(self._free) < self.MAX_SEGMENTS
                    and sum(b.nbytes for b in self._free) + segment.nbytes <= self.max_bytes)
            self._lent.discard(id(segment))
            if keep:
                self._free.append(segment)
                return
        segment.close()

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)


class Segments:
    """Checkpoint memory: memfds the daemon fills, seals against writes, then lends to its job's trainers to
    map read-only (a restore copies once, from pages that already exist, into the state dict)."""

    def __init__(self, pool: SegmentPool) -> None:
        self.pool = pool
        self.pending: list[tuple[str, SharedBuffer]] = []  # made, not yet sealed and given to a checkpoint
        self.offsets: dict[str, tuple[str, int]] = {}  # key -> (segment id, offset) of what was allocated

    def allocate(self, lengths: Sequence[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Room for each (key, length): views of one new segment (empty objects: empty tensors)."""
        offsets, total = {}, 0
        for key, n in lengths:
            if n:
                offsets[key] = total
                total += -(-n // ALIGN) * ALIGN
        room = {key: torch.empty(0, dtype=torch.uint8) for key, n in lengths if not n}
        if not total:
            return room
        segment_id = secrets.token_hex(8)
        segment = self.pool.take(total)
        self.pending.append((segment_id, segment))
        for key, n in lengths:
            if n:
                room[key] = segment.view(torch.uint8, offsets[key], n)
                self.offsets[key] = (segment_id, offsets[key])
        return room

    def give(self, c: Checkpoint) -> None:
        """Seal what was filled and hand it to `c` (its objects are views of it)."""
        for segment_id, segment in self.pending:
            segment.seal_writes()
            c.segments[segment_id] = segment
        c.places.update({k: v for k, v in self.offsets.items() if k in c.objects})
        self.pending.clear()

    def discard(self) -> None:
        for _, segment in self.pending:
            self.pool.recycle(segment)
        self.pending.clear()


@dataclass(frozen=True)
class DataPlane:
    comm: Communicator | None  # None: a one-node cluster (nothing to replicate to)
    generation: int
    nodes: Sequence[int]  # the generation's members: their --rank, by rank in the generation


@dataclass(frozen=True)
class ObjectRef:
    key: str
    offset: int
    length: int


@dataclass(frozen=True)
class CheckpointSummary:
    step: int
    state: str
    nbytes: int
    metadata_length: int
    reason: str
    holders: tuple[int, ...]


class CheckpointKeeper:
    """Args:
        store: the bounded store (checkpoints.py).
        buffer: a session's shared buffer by (session id, buffer id) (BufferServer.get: checks it is the
            session's).
        data_plane: the current generation's communicator and members.
        replicas: copies of each node's objects on other nodes (GEMINI's m - 1).
        timeout_s: how long a replication round waits for a peer's message.
        busy: whether a gradient step is in flight on this node.
        record: metrics: (job, step, seconds or None when it failed).
        recovered: metrics: (bytes, seconds) of a checkpoint recovered from a peer by a census.
    """

    def __init__(self, store: CheckpointStore, buffer: Callable[[str, str], Any], data_plane: Callable[[], DataPlane],
                 replicas: int, timeout_s: float, busy: Callable[[], bool] = lambda: False,
                 record: Callable[[str, int, float | None], None] = lambda job, step, seconds: None,
                 recovered: Callable[[int, float], None] = lambda nbytes, seconds: None):
        self.store, self.buffer, self.data_plane = store, buffer, data_plane
        self.pool = SegmentPool(max(store.max_bytes // 4, 0))
        store.recycle = self.pool.recycle
        self.replicas, self.timeout_s, self.busy, self.record = replicas, timeout_s, busy, record
        self.recovered = recovered
        self._lock = threading.Lock()
        self._jobs: dict[str, str] = {}  # job_key -> job, every job a trainer opened a session of here
        self._watcher: Callable[[str, int, int], None] | None = None
        # work for the thread, in order: ("replicate", job, step, since) or ("census", generation)
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._settled = threading.Event()  # no census pending: what this node holds is what it will hold
        self._settled.set()
        self._thread = threading.Thread(target=self._work_loop, name="zen-checkpoints", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ admission of checkpoint tags
    def note_job(self, job: str) -> None:
        """A trainer of `job` opened a session here: its checkpoint tags are taken from now on."""
        key = job_key(job)
        with self._lock:
            if key in self._jobs:
                return
            self._jobs[key] = job
            last = self.store.last_complete(job)
            watcher = self._watcher
        if watcher is not None:
            watcher(key, CKPT_TENSOR, last)

    def watch_last_steps(self, watcher: Callable[[str, int, int], None] | None) -> None:
        """As JobRegistry.watch_last_steps, for the checkpoint tags (a native engine's admission table)."""
        with self._lock:
            self._watcher = watcher
            known = [(key, self.store.last_complete(job)) for key, job in self._jobs.items()]
        if watcher is not None:
            for key, last in known:
                watcher(key, CKPT_TENSOR, last)

    def last_step(self, key: str) -> int | None:
        """The newest complete checkpoint step of the job with this job_key (-1: none), None if unknown here."""
        job = self._jobs.get(key)
        return None if job is None else self.store.last_complete(job)

    # ------------------------------------------------------------------ trainers
    def put(self, session: Session, step: int, buffer_id: str, objects: Sequence[ObjectRef], rank: int,
            world_size: int, coordinator: bool, done: bool) -> int:
        """Copy `objects` out of the session's buffer into checkpoint `step`; the job's bytes held after it."""
        job = session.job
        self.note_job(job)
        buffer = self.buffer(session.session_id, buffer_id) if objects else None
        if buffer is not None:
            buffer.acquire()
        with self._lock:
            c = self.store.begin(job, step, world_size, rank, session.local_world_size)
            if objects:
                assert buffer is not None
                self.store.room(job, sum(o.length for o in objects))
                if any(o.key == METADATA_KEY for o in objects) and not coordinator:
                    raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {step}: rank {rank} sent metadata but "
                                                            "is not the coordinator")
                for o in objects:
                    buffer.view(torch.uint8, o.offset, o.length)  # every range checked before anything is kept
                segments = Segments(self.pool)
                try:
                    room = segments.allocate([(o.key, o.length) for o in objects if o.key != METADATA_KEY])
                    for o in objects:
                        data = buffer.view(torch.uint8, o.offset, o.length)
                        if o.key == METADATA_KEY:
                            self.store.put(c, o.key, data.clone(), own=False)
                        else:
                            room[o.key].copy_(data)
                            self.store.put(c, o.key, room[o.key])
                    segments.give(c)
                except BaseException as exc:  # the step is this node's no more: nothing half-put is kept
                    segments.discard()
                    self.store.fail(job, step, f"rank {rank}'s objects were refused: {exc}")
                    raise
            whole = done and self.store.done(c, rank, coordinator, session.local_world_size)
            if whole:
                c.state = "replicating"
            held = self.store.job_bytes(job)
        if whole:
            self._queue.put(("replicate", job, step, time.monotonic()))
        return held

    def summaries(self, job: str) -> list[CheckpointSummary]:
        """The job's checkpoints here: complete ones first, newest first (after a census under way)."""
        self.wait_settled()
        with self._lock:
            steps = list(self.store.jobs.get(job, {}).values())
            out = [CheckpointSummary(c.step, c.state, c.nbytes,
                                     c.metadata.numel() if c.metadata is not None else 0, c.reason, c.holders)
                   for c in steps]
        return sorted(out, key=lambda s: (s.state != "complete", -s.step))

    def read(self, session: Session, step: int, buffer_id: str, objects: Sequence[ObjectRef]) -> int:
        """Copy objects of complete checkpoint `step` into the session's buffer; the bytes copied."""
        buffer = self.buffer(session.session_id, buffer_id)
        self.wait_settled()
        with self._lock:
            c = self.store.readable(session.job, step)
            sources = []
            for o in objects:
                data = self.store.object(c, o.key)
                if data.numel() != o.length:
                    raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {step}: object {o.key[:60]!r} has "
                                                            f"{data.numel()} bytes, the read asks for {o.length}")
                sources.append((data, o))
            total = 0
            for data, o in sources:  # under the lock: a freed segment may be filled again for a newer step
                buffer.view(torch.uint8, o.offset, o.length).copy_(data)
                total += o.length
        buffer.publish()
        return total

    def locate(self, session: Session, step: int, keys: Sequence[str]) -> list[tuple[str, str, int, int, int]]:
        """(key, segment id or "", offset, length, segment bytes) of objects of complete checkpoint `step`."""
        self.wait_settled()
        with self._lock:
            c = self.store.readable(session.job, step)
            out = []
            for key in keys:
                data = self.store.object(c, key)
                segment_id, offset = c.places.get(key, ("", 0))
                segment = c.segments.get(segment_id)
                out.append((key, segment_id if segment is not None else "", offset, data.numel(),
                            segment.nbytes if segment is not None else 0))
        return out

    def segment(self, job: str, step: int, segment_id: str) -> tuple[int, int]:
        """(bytes, a duplicate descriptor) of a segment of complete checkpoint `step` of `job`, sealed against
        writes: the trainer maps it read-only."""
        with self._lock:
            c = self.store.readable(job, step)
            segment = c.segments.get(segment_id)
            if segment is None:
                raise StepError(codes.NOT_FOUND, f"checkpoint step {step} has no segment {segment_id[:20]!r}")
            self.pool.lent(segment)  # never reused: the trainer may map it after the checkpoint is freed
            return segment.nbytes, os.dup(segment.fileno())

    def held_bytes(self) -> int:
        return self.store.held

    def job_status(self) -> list[tuple[str, int, list[int], int]]:
        """(job, last complete step, steps held, bytes) for every job with checkpoints here."""
        with self._lock:
            return [(job, self.store.last_complete(job), sorted(steps), self.store.job_bytes(job))
                    for job, steps in self.store.jobs.items() if steps]

    # ------------------------------------------------------------------ recovery
    def new_generation(self, generation: int) -> None:
        """A generation of more than one node formed: hold reads until its census has run."""
        self._settled.clear()
        self._queue.put(("census", generation))

    def wait_settled(self) -> None:
        if not self._settled.wait(self.timeout_s):
            raise StepError(codes.UNAVAILABLE, f"the checkpoint census of this generation has not finished in "
                                               f"{self.timeout_s:g} s; try again")

    def _census(self, generation: int) -> None:
        plane = self.data_plane()
        if plane.comm is None or plane.generation != generation:  # a newer one is queued behind
            return
        me = plane.comm.rank
        with self._lock:
            mine = CensusOffer(plane.nodes[me], {job: h for job in self.store.jobs
                                                 if (h := self._holding(job)) is not None})
        prefix = f"{CENSUS_KEY}/{CENSUS_TENSOR}/{generation}/0/"
        started = time.monotonic()
        segments: dict[str, Segments] = {}  # by job
        try:
            recovered, decided = run_census(
                plane.comm, prefix, mine, self._object, self.timeout_s,
                lambda job, lengths: segments.setdefault(job, Segments(self.pool)).allocate(lengths))
        except Exception as exc:  # a failed census: what is held stays, nothing is restored
            for each in segments.values():
                each.discard()
            log.warning("checkpoint census failed", extra={"event": "checkpoint_census_failed",
                                                           "generation": generation, "reason": str(exc)[:500]})
            return
        node = plane.nodes[me]
        for r in recovered:
            sender = next(t.sender for t in decided.transfers if t.job == r.job and t.receiver == me)
            c = Checkpoint(r.step, 0, objects=r.objects, own_keys=set(r.holding.copies.get(node, {})),
                           state="complete", holders=(node, plane.nodes[sender]), nodes=r.holding.nodes,
                           writers=r.holding.writers, copies={node: tuple(r.holding.copies.get(node, {}))})
            held = segments.pop(r.job, Segments(self.pool))
            with self._lock:
                try:
                    self.store.room(r.job, c.nbytes)
                except StepError as exc:
                    held.discard()
                    self.store.lose(r.job, r.step, f"checkpoint step {r.step} was recovered from a peer but does not "
                                                   f"fit here: {exc.message}")
                    continue
                held.give(c)
                self.store.install(r.job, c)
            self.note_job(r.job)
            self._tell(r.job)
            seconds = time.monotonic() - started
            self.recovered(c.nbytes, seconds)
            log.info("checkpoint recovered from a peer", extra={
                "event": "checkpoint_recovered", "job": r.job, "step": r.step, "bytes": c.nbytes,
                "seconds": round(seconds, 4), "from_node": plane.nodes[sender]})
        for job, (step, why) in decided.lost.items():
            with self._lock:
                self.store.lose(job, step, why)
            log.error("checkpoint lost", extra={"event": "checkpoint_lost", "job": job, "step": step, "reason": why})

    def _holding(self, job: str) -> JobHolding | None:
        """(locked) What this node holds of the job's newest complete step, for the census."""
        last = self.store.last_complete(job)
        c = self.store.jobs[job].get(last)
        if c is None or c.metadata is None or not c.nodes:
            return None
        copies = {n: {k: c.objects[k].numel() for k in keys if k in c.objects} for n, keys in c.copies.items()}
        return JobHolding(last, c.nodes, c.writers, copies, c.metadata.numel())

    def _object(self, job: str, step: int, key: str) -> torch.Tensor:
        with self._lock:
            return self.store.jobs[job][step].objects[key]

    def _tell(self, job: str) -> None:
        watcher = self._watcher
        if watcher is not None:
            watcher(job_key(job), CKPT_TENSOR, self.store.last_complete(job))

    # ------------------------------------------------------------------ replication
    def _work_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if item[0] == "census":
                    self._census(item[1])
                else:
                    self._replicate(*item[1:])
            except Exception:  # the loop serves every later item
                log.exception("checkpoint work %r failed", item[:3])
                if item[0] == "replicate":
                    self._fail(item[1], item[2], "replication failed unexpectedly (see the daemon's log)")
            finally:
                if item[0] == "census" and not any(i is not None and i[0] == "census" for i in list(self._queue.queue)):
                    self._settled.set()

    def _replicate(self, job: str, step: int, since: float) -> None:
        with self._lock:
            c = self.store.jobs.get(job, {}).get(step)
            if c is None or c.state != "replicating":
                return
            mine = self._offer(c)
            objects = {k: c.objects[k] for k in c.own_keys}
        plane = self.data_plane()
        nodes = list(plane.nodes)
        if plane.comm is None or plane.comm.world_size == 1:
            self._complete(job, step, since, None, nodes[:1] or [0])
            return
        prefix = f"{job_key(job)}/{CKPT_TENSOR}/{step}/{plane.generation}/"
        segments = Segments(self.pool)
        try:
            done = replicate(plane.comm, prefix, step, mine, objects, self.replicas, self.timeout_s, self._pace,
                             segments.allocate)
        except Exception as exc:
            segments.discard()
            self._fail(job, step, str(exc))
            return
        self._complete(job, step, since, done, nodes, segments)

    @staticmethod
    def _offer(c: Checkpoint) -> Offer:
        return Offer(c.world_size, tuple(sorted(c.done_ranks)), {k: c.objects[k].numel() for k in c.own_keys},
                     c.metadata)

    def _pace(self) -> None:
        deadline = time.monotonic() + PACE_WAIT_S
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _complete(self, job: str, step: int, since: float, done: Replicated | None, nodes: list[int],
                  segments: Segments | None = None) -> None:
        with self._lock:
            c = self.store.jobs.get(job, {}).get(step)
            if c is None:
                if segments is not None:
                    segments.discard()
                return
            if done is None:  # one node: nobody to replicate to
                holders: tuple[int, ...] = (nodes[0],)
                c.nodes, c.writers, c.copies = holders, holders if c.own_keys else (), {nodes[0]: tuple(c.own_keys)}
            else:
                holders = tuple(nodes[r] for r in done.holders)
                c.nodes = tuple(nodes)
                c.writers = tuple(nodes[r] for r, o in sorted(done.offers.items()) if o.objects)
                me = done.holders[0]
                c.copies = {nodes[me]: tuple(c.own_keys),
                            **{nodes[j]: tuple(done.offers[j].objects) for j in done.held_for}}
                if METADATA_KEY not in c.objects:
                    self.store.put(c, METADATA_KEY, done.metadata, own=False)
                for key, data in done.objects.items():  # replicas: held past the bound rather than lost
                    if key not in c.objects:
                        self.store.put(c, key, data, own=False)
                if segments is not None:
                    segments.give(c)
            self.store.complete(job, step, holders)
            watcher = self._watcher
        seconds = time.monotonic() - since
        self.record(job, step, seconds)
        log.info("checkpoint complete", extra={"event": "checkpoint_complete", "job": job, "step": step,
                                               "seconds": round(seconds, 3), "holders": list(holders)})
        if watcher is not None:
            watcher(job_key(job), CKPT_TENSOR, step)

    def _fail(self, job: str, step: int, reason: str) -> None:
        with self._lock:
            self.store.fail(job, step, reason)
        self.record(job, step, None)
        log.warning("checkpoint failed", extra={"event": "checkpoint_failed", "job": job, "step": step,
                                                "reason": reason[:500]})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
