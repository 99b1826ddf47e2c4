"""What this daemon holds of its jobs' in-memory checkpoints (GEMINI), bounded, and when a step is whole here.

A checkpoint of step k of a job is a set of *objects* (the bytes of DCP's write items, by key) and its
metadata (key ""). This node's trainers put theirs; the node's part is *whole* once every local trainer
of the job said it is done and, if DCP's coordinator trainer is one of them, the metadata is in. Then
the replication (checkpoint_replication.py) gives the step to its holders and marks it complete, or
failed, the same way on every node. States: writing -> replicating -> complete | failed.

Kept: the newest complete step, the complete step before it (a load agrees on the newest step complete
on *every* node, and the commit may leave the nodes one step apart), and steps still being written.
Everything else is freed when a step completes or fails. Memory is bounded per daemon and per job; a
put beyond either frees the older of the two kept complete steps first, then is refused naming the bound.

Pure bookkeeping: no I/O and no threads; the daemon's CheckpointKeeper holds the lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zend.daemon import errors as codes
from zend.daemon.errors import StepError
from zend.protocol.checkpoint import METADATA_KEY

MAX_KEY_CHARS = 1024  # a DCP item's key: its fully qualified name and chunk offsets
MAX_OBJECTS_PER_STEP = 1 << 20
MAX_STEP = (1 << 63) - 1
STATES = ("writing", "replicating", "complete", "failed")


@dataclass
class Checkpoint:
    step: int
    world_size: int  # trainers of the job (DCP's process group)
    objects: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> uint8 bytes (the metadata under "")
    done_ranks: set[int] = field(default_factory=set)  # local trainers that put everything
    local_ranks: set[int] = field(default_factory=set)  # local trainers that put anything
    coordinator_here: bool = False  # DCP's coordinator is a local trainer: wait for the metadata too
    own_keys: set[str] = field(default_factory=set)  # objects this node's trainers put (the rest: replicas)
    state: str = "writing"
    reason: str = ""  # why it failed
    holders: tuple[int, ...] = ()  # nodes (by --rank) that hold a whole copy of this node's objects
    # once complete, for recovery (checkpoint_recovery.py): the nodes (--rank) of the step's generation, those
    # whose trainers wrote objects, and the keys of each node whose objects this node holds whole (itself too)
    nodes: tuple[int, ...] = ()
    writers: tuple[int, ...] = ()
    copies: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # the memory its objects are views of: segments (closed when the checkpoint is freed) by id, and each
    # object's (segment id, offset); an object in none (the metadata) is read by copy
    segments: dict[str, Any] = field(default_factory=dict)
    places: dict[str, tuple[str, int]] = field(default_factory=dict)

    def release(self, recycle: Any = None) -> None:
        """Drop the objects and hand each segment to `recycle` (else close it: a view still in use keeps its
        pages until dropped)."""
        self.objects.clear()
        self.own_keys.clear()
        self.places.clear()
        for segment in self.segments.values():
            if recycle is not None:
                recycle(segment)
            else:
                segment.close()
        self.segments.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.objects.values())

    @property
    def metadata(self) -> torch.Tensor | None:
        return self.objects.get(METADATA_KEY)


def check_key(key: str) -> None:
    if len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise StepError(codes.INVALID_ARGUMENT, f"checkpoint object key {key[:60]!r} must be at most {MAX_KEY_CHARS} "
                                                "printable characters")


class CheckpointStore:
    """Args:
        max_bytes: the most checkpoint bytes this daemon holds (--checkpoint-memory-bytes).
        max_job_bytes: the most one job's checkpoints hold (--checkpoint-job-bytes).
    """

    def __init__(self, max_bytes: int, max_job_bytes: int, recycle: Any = None):
        """`recycle(segment)`: what becomes of a freed checkpoint's segments (default: closed)."""
        self.max_bytes, self.max_job_bytes = max_bytes, max_job_bytes
        self.recycle = recycle
        self.jobs: dict[str, dict[int, Checkpoint]] = {}
        self.held = 0  # bytes over every job

    # ------------------------------------------------------------------ writing
    def job_bytes(self, job: str) -> int:
        return sum(c.nbytes for c in self.jobs.get(job, {}).values())

    def last_complete(self, job: str) -> int:
        """The newest complete step of the job here, -1 if none."""
        return max((s for s, c in self.jobs.get(job, {}).items() if c.state == "complete"), default=-1)

    def begin(self, job: str, step: int, world_size: int, rank: int, local_world_size: int) -> Checkpoint:
        """The checkpoint `step` of `job` that a local trainer of rank `rank` writes into (created if new)."""
        if not 0 <= step <= MAX_STEP:
            raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {step} is not in [0, 2^63)")
        if not 1 <= world_size <= 1 << 20 or not 0 <= rank < world_size:
            raise StepError(codes.INVALID_ARGUMENT, f"checkpoint rank {rank} of world size {world_size}: need "
                                                    "0 <= rank < world_size <= 2^20")
        steps = self.jobs.setdefault(job, {})
        last = self.last_complete(job)
        if step <= last:
            raise StepError(codes.FAILED_PRECONDITION, f"checkpoint step {step} of job {job!r}: step {last} is "
                                                       "complete already (steps only move forward)")
        c = steps.get(step)
        if c is None:
            c = steps[step] = Checkpoint(step, world_size)
        if c.state != "writing":
            raise StepError(codes.FAILED_PRECONDITION, f"checkpoint step {step} of job {job!r} is {c.state} "
                                                       f"already{': ' + c.reason if c.reason else ''}")
        if c.world_size != world_size:
            raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {step}: rank {rank} says world size "
                                                    f"{world_size}, another trainer said {c.world_size}")
        if rank in c.done_ranks:
            raise StepError(codes.FAILED_PRECONDITION, f"checkpoint step {step}: rank {rank} said it was done")
        if rank not in c.local_ranks and len(c.local_ranks) >= local_world_size:
            raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {step}: rank {rank} would be trainer "
                                                    f"{len(c.local_ranks) + 1} of this node, which has "
                                                    f"{local_world_size} (local_world_size)")
        c.local_ranks.add(rank)
        return c

    def room(self, job: str, nbytes: int) -> None:
        """Make room for `nbytes` more of `job`: if it does not fit, its complete steps older than the newest
        are freed, oldest first, but only when that makes it fit; else RESOURCE_EXHAUSTED naming the bound
        (and nothing freed)."""
        steps = self.jobs.get(job, {})
        older = sorted(s for s, c in steps.items() if c.state == "complete")[:-1]
        freeable = sum(steps[s].nbytes for s in older)
        job_held = self.job_bytes(job)
        if self.held + nbytes - freeable > self.max_bytes:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"checkpoint of {nbytes} more bytes refused: this daemon holds "
                                                      f"{self.held} checkpoint bytes, its bound is {self.max_bytes} "
                                                      "(--checkpoint-memory-bytes)")
        if job_held + nbytes - freeable > self.max_job_bytes:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"checkpoint of {nbytes} more bytes refused: job {job!r} holds "
                                                      f"{job_held} checkpoint bytes on this node, its bound is "
                                                      f"{self.max_job_bytes} (--checkpoint-job-bytes)")
        for s in older:
            if self.job_bytes(job) + nbytes <= self.max_job_bytes and self.held + nbytes <= self.max_bytes:
                return
            self._drop(job, s)

    def put(self, c: Checkpoint, key: str, data: torch.Tensor, own: bool = True) -> None:
        """(after `room`) Keep `data` (uint8, owned by the store from now on) as object `key`."""
        check_key(key)
        if key in c.objects:
            raise StepError(codes.INVALID_ARGUMENT, f"checkpoint step {c.step}: object {key[:60]!r} was put twice")
        if len(c.objects) >= MAX_OBJECTS_PER_STEP:
            raise StepError(codes.RESOURCE_EXHAUSTED, f"checkpoint step {c.step}: more than {MAX_OBJECTS_PER_STEP} "
                                                      "objects")
        c.objects[key] = data
        if own:
            c.own_keys.add(key)
        self.held += data.numel()

    def done(self, c: Checkpoint, rank: int, coordinator: bool, local_world_size: int) -> bool:
        """Rank `rank` put everything; True once this node's part of the step is whole."""
        c.done_ranks.add(rank)
        c.coordinator_here = c.coordinator_here or coordinator
        return self.whole(c, local_world_size)

    @staticmethod
    def whole(c: Checkpoint, local_world_size: int) -> bool:
        return (c.state == "writing" and len(c.done_ranks) >= local_world_size
                and (not c.coordinator_here or c.metadata is not None))

    # ------------------------------------------------------------------ outcomes
    def complete(self, job: str, step: int, holders: tuple[int, ...]) -> None:
        """Step `step` is complete on this node: free what is neither it, the complete step before it, nor
        newer."""
        steps = self.jobs[job]
        c = steps[step]
        c.state, c.holders = "complete", holders
        self._trim(job, step)

    def install(self, job: str, c: Checkpoint) -> None:
        """A complete checkpoint recovered from peers (checkpoint_recovery.py), replacing what was held of
        its step; its bytes are counted, older steps trimmed as by `complete`."""
        steps = self.jobs.setdefault(job, {})
        old = steps.pop(c.step, None)
        if old is not None:
            self.held -= old.nbytes
            old.release(self.recycle)
        steps[c.step] = c
        self.held += c.nbytes
        self._trim(job, c.step)

    def lose(self, job: str, step: int, reason: str) -> None:
        """Step `step` can no longer be restored anywhere (a node's objects lost with every copy)."""
        if step not in self.jobs.setdefault(job, {}):  # a node that held nothing: its trainers are told why
            self.jobs[job][step] = Checkpoint(step, 0)
        self.fail(job, step, reason)

    def _trim(self, job: str, step: int) -> None:
        steps = self.jobs[job]
        earlier = [s for s, x in steps.items() if s < step and x.state == "complete"]
        keep = {step, max(earlier, default=-1)}
        for s in [s for s in steps if s < step and s not in keep]:
            self._drop(job, s)

    def fail(self, job: str, step: int, reason: str) -> None:
        """Step `step` failed: its objects are freed (a failed checkpoint is never loaded)."""
        c = self.jobs.get(job, {}).get(step)
        if c is None:
            return
        self.held -= c.nbytes
        c.release(self.recycle)
        c.state, c.reason = "failed", reason
        self._trim_failed(job)

    def _trim_failed(self, job: str, keep: int = 4) -> None:
        failed = sorted(s for s, c in self.jobs[job].items() if c.state == "failed")
        for s in failed[:-keep]:  # a few are kept so that a trainer can be told why
            del self.jobs[job][s]

    def _drop(self, job: str, step: int) -> None:
        c = self.jobs[job].pop(step)
        self.held -= c.nbytes
        c.release(self.recycle)

    def drop_job(self, job: str) -> None:
        for step in list(self.jobs.get(job, {})):
            self._drop(job, step)
        self.jobs.pop(job, None)

    # ------------------------------------------------------------------ reading
    def readable(self, job: str, step: int) -> Checkpoint:
        """A complete checkpoint of the job, else NOT_FOUND / FAILED_PRECONDITION saying what there is."""
        c = self.jobs.get(job, {}).get(step)
        if c is None:
            have = sorted(s for s, x in self.jobs.get(job, {}).items() if x.state == "complete")
            raise StepError(codes.NOT_FOUND, f"job {job!r} has no checkpoint of step {step} on this node "
                                             f"(complete here: {have or 'none'})")
        if c.state != "complete":
            raise StepError(codes.FAILED_PRECONDITION, f"checkpoint step {step} of job {job!r} is {c.state}, not "
                                                       f"complete{': ' + c.reason if c.reason else ''}")
        return c

    def object(self, c: Checkpoint, key: str) -> torch.Tensor:
        data = c.objects.get(key)
        if data is None:
            what = "metadata" if key == METADATA_KEY else f"object {key[:80]!r}"
            raise StepError(codes.NOT_FOUND, f"checkpoint step {c.step}: this node holds no {what} of it (held by "
                                             f"nodes {list(c.holders)}; reading another node's objects is not built "
                                             "yet)")
        return data
