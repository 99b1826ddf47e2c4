"""The in-memory checkpoint store (zend/daemon/checkpoints.py): when a node's part of a step is whole, what
`begin` refuses, the two bounds, which steps are kept, failed and lost steps, and the byte accounting."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from zend.daemon import errors as codes
from zend.daemon.checkpoints import (
    MAX_KEY_CHARS,
    METADATA_KEY,
    Checkpoint,
    CheckpointStore,
    check_key,
)
from zend.daemon.errors import StepError

pytestmark = pytest.mark.inprocess

JOB = "job-a"


def data(n: int, fill: int = 7) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


def store(max_bytes: int = 1 << 20, max_job_bytes: int = 1 << 20) -> CheckpointStore:
    return CheckpointStore(max_bytes, max_job_bytes)


def write(s: CheckpointStore, step: int, nbytes: int, job: str = JOB, complete: bool = False) -> Checkpoint:
    """One trainer (rank 0 of 1, the coordinator) writes `nbytes` of objects and the metadata of `step`."""
    c = s.begin(job, step, 1, 0, 1)
    s.room(job, nbytes + 1)
    s.put(c, "obj", data(nbytes, step % 256))
    s.put(c, METADATA_KEY, data(1), own=False)
    assert s.done(c, 0, True, 1)
    if complete:
        s.complete(job, step, (0,))
    return c


def states(s: CheckpointStore, job: str = JOB) -> dict[int, str]:
    return {step: c.state for step, c in sorted(s.jobs.get(job, {}).items())}


@contextmanager
def refused(code: str, *words: str) -> Iterator[None]:
    """The block raises a StepError of `code` whose message holds every one of `words`."""
    with pytest.raises(StepError) as info:
        yield
    assert info.value.code == code, (info.value.code, info.value.message)
    for w in words:
        assert w in info.value.message, (w, info.value.message)


# ---------------------------------------------------------------------- whole


def test_a_step_is_whole_only_once_every_local_trainer_is_done_and_the_coordinators_metadata_is_in() -> None:
    s = store()
    c = s.begin(JOB, 3, 4, 0, 2)  # ranks 0 and 1 of 4 on this node; rank 0 is DCP's coordinator
    s.put(c, "a", data(10))
    assert not s.done(c, 0, True, 2)  # rank 1 is not done
    assert s.begin(JOB, 3, 4, 1, 2) is c
    s.put(c, "b", data(5))
    assert not s.done(c, 1, False, 2)  # both done, but the metadata is missing
    assert c.coordinator_here
    assert not CheckpointStore.whole(c, 2)
    s.put(c, METADATA_KEY, data(3), own=False)
    assert CheckpointStore.whole(c, 2)
    assert c.own_keys == {"a", "b"}  # the metadata is not one of the node's own objects
    assert c.metadata is not None and c.metadata.numel() == 3
    assert c.nbytes == 18 and s.held == 18 and s.job_bytes(JOB) == 18
    c.state = "replicating"
    assert not CheckpointStore.whole(c, 2)  # only a writing step becomes whole


def test_without_the_coordinator_a_step_is_whole_once_every_local_trainer_is_done() -> None:
    s = store()
    c = s.begin(JOB, 0, 4, 2, 2)
    s.put(c, "a", data(4))
    assert not s.done(c, 2, False, 2)
    s.begin(JOB, 0, 4, 3, 2)
    assert s.done(c, 3, False, 2)
    assert not c.coordinator_here and c.metadata is None


# ---------------------------------------------------------------------- begin


def test_begin_refuses_a_step_at_or_below_the_last_complete_one() -> None:
    s = store()
    write(s, 5, 4, complete=True)
    assert s.last_complete(JOB) == 5
    for step in (5, 4, 0):
        with refused(codes.FAILED_PRECONDITION, f"checkpoint step {step}", "step 5 is complete", repr(JOB)):
            s.begin(JOB, step, 1, 0, 1)
    assert s.begin(JOB, 6, 1, 0, 1).step == 6


def test_begin_refuses_a_world_size_other_than_the_first_trainers() -> None:
    s = store()
    s.begin(JOB, 1, 4, 0, 2)
    with refused(codes.INVALID_ARGUMENT, "rank 1 says world size 8", "another trainer said 4"):
        s.begin(JOB, 1, 8, 1, 2)


def test_begin_refuses_a_rank_that_said_it_was_done() -> None:
    s = store()
    c = s.begin(JOB, 1, 4, 0, 2)
    s.done(c, 0, False, 2)
    with refused(codes.FAILED_PRECONDITION, "checkpoint step 1", "rank 0 said it was done"):
        s.begin(JOB, 1, 4, 0, 2)
    assert s.begin(JOB, 1, 4, 1, 2) is c  # the other local trainer still may


def test_begin_refuses_more_local_trainers_than_local_world_size() -> None:
    s = store()
    s.begin(JOB, 1, 8, 0, 2)
    s.begin(JOB, 1, 8, 1, 2)
    s.begin(JOB, 1, 8, 1, 2)  # the same trainer again is no new one
    with refused(codes.INVALID_ARGUMENT, "rank 5 would be trainer 3 of this node, which has 2"):
        s.begin(JOB, 1, 8, 5, 2)
    assert s.jobs[JOB][1].local_ranks == {0, 1}


@pytest.mark.parametrize(("step", "world", "rank", "words"), [
    (-1, 4, 0, ("checkpoint step -1",)),
    (1 << 63, 4, 0, (f"checkpoint step {1 << 63}",)),
    (1, 4, 4, ("rank 4 of world size 4",)),
    (1, 4, -1, ("rank -1 of world size 4",)),
    (1, 0, 0, ("rank 0 of world size 0",)),
    (1, (1 << 20) + 1, 0, (f"world size {(1 << 20) + 1}",)),
])
def test_begin_refuses_a_step_or_rank_out_of_range(step: int, world: int, rank: int, words: tuple[str, ...]) -> None:
    s = store()
    with refused(codes.INVALID_ARGUMENT, *words):
        s.begin(JOB, step, world, rank, 1)
    assert not s.jobs.get(JOB)


def test_begin_refuses_a_failed_step_naming_its_reason() -> None:
    s = store()
    s.begin(JOB, 2, 1, 0, 1)
    s.fail(JOB, 2, "node 3 went away")
    with refused(codes.FAILED_PRECONDITION, "checkpoint step 2", "is failed already: node 3 went away"):
        s.begin(JOB, 2, 1, 0, 1)


# ---------------------------------------------------------------------- bounds


def test_room_refuses_past_the_daemons_bound_naming_it() -> None:
    s = store(max_bytes=100, max_job_bytes=1000)
    write(s, 1, 59, job="other")  # another job's bytes count against the daemon's bound
    s.room(JOB, 40)
    with refused(codes.RESOURCE_EXHAUSTED, "41 more bytes", "holds 60", "bound is 100", "--checkpoint-memory-bytes"):
        s.room(JOB, 41)
    assert s.held == 60


def test_room_refuses_past_the_jobs_bound_naming_it() -> None:
    s = store(max_bytes=1000, max_job_bytes=50)
    write(s, 1, 29)
    write(s, 1, 40, job="other")  # not this job's bytes
    s.room(JOB, 20)
    with refused(codes.RESOURCE_EXHAUSTED, "21 more bytes", repr(JOB), "holds 30", "bound is 50",
                 "--checkpoint-job-bytes"):
        s.room(JOB, 21)


def test_room_frees_the_older_of_two_complete_steps_before_refusing() -> None:
    s = store(max_bytes=1000, max_job_bytes=100)
    write(s, 1, 39, complete=True)
    write(s, 2, 39, complete=True)
    assert states(s) == {1: "complete", 2: "complete"} and s.held == 80
    s.room(JOB, 50)  # 80 + 50 > 100, 40 + 50 fits once step 1 is freed
    assert states(s) == {2: "complete"} and s.held == 40 and s.job_bytes(JOB) == 40
    with refused(codes.RESOURCE_EXHAUSTED, "--checkpoint-job-bytes"):
        s.room(JOB, 61)  # the newest complete step is never freed
    assert states(s) == {2: "complete"} and s.held == 40


def test_room_frees_the_older_complete_step_for_the_daemons_bound_too() -> None:
    s = store(max_bytes=100, max_job_bytes=1000)
    write(s, 1, 39, complete=True)
    write(s, 2, 39, complete=True)
    s.room(JOB, 50)
    assert states(s) == {2: "complete"} and s.held == 40
    with refused(codes.RESOURCE_EXHAUSTED, "--checkpoint-memory-bytes"):
        s.room(JOB, 61)


def test_room_never_frees_a_step_being_written() -> None:
    s = store(max_bytes=1000, max_job_bytes=100)
    write(s, 1, 39, complete=True)
    write(s, 2, 39)  # whole, not complete
    with refused(codes.RESOURCE_EXHAUSTED, "holds 80"):
        s.room(JOB, 30)
    assert states(s) == {1: "complete", 2: "writing"} and s.held == 80


# ---------------------------------------------------------------------- outcomes


def test_complete_keeps_the_newest_complete_step_and_the_one_before() -> None:
    s = store()
    write(s, 1, 10, complete=True)
    write(s, 2, 20, complete=True)
    assert states(s) == {1: "complete", 2: "complete"}
    write(s, 3, 30)  # written, never completed
    write(s, 4, 40)
    write(s, 5, 50)  # newer: still being written
    s.complete(JOB, 4, (0, 1))
    assert states(s) == {2: "complete", 4: "complete", 5: "writing"}
    assert s.jobs[JOB][4].holders == (0, 1)
    assert s.held == 21 + 41 + 51 == sum(c.nbytes for c in s.jobs[JOB].values())
    assert s.last_complete(JOB) == 4
    s.complete(JOB, 5, (0,))
    assert states(s) == {4: "complete", 5: "complete"}
    assert s.held == 41 + 51


def test_complete_frees_a_failed_step_below_it() -> None:
    s = store()
    write(s, 1, 10)
    s.fail(JOB, 1, "no")
    write(s, 2, 10, complete=True)
    assert states(s) == {2: "complete"} and s.held == 11


def test_fail_frees_the_bytes_and_reading_the_step_names_the_reason() -> None:
    s = store()
    write(s, 1, 10, complete=True)
    c = write(s, 2, 30)
    assert s.held == 11 + 31
    s.fail(JOB, 2, "trainer ranks [3] wrote nothing")
    assert s.held == 11 and c.objects == {} and c.own_keys == set() and c.nbytes == 0
    assert states(s) == {1: "complete", 2: "failed"}
    with refused(codes.FAILED_PRECONDITION, "checkpoint step 2", "is failed, not complete",
                 "trainer ranks [3] wrote nothing"):
        s.readable(JOB, 2)
    assert s.readable(JOB, 1).step == 1  # the step before stays readable
    s.fail(JOB, 2, "again")  # idempotent on the bytes
    assert s.held == 11
    s.fail(JOB, 9, "never begun")  # nothing to fail
    assert 9 not in s.jobs[JOB]


def test_only_the_four_newest_failed_steps_are_kept() -> None:
    s = store()
    for step in range(1, 7):
        s.begin(JOB, step, 1, 0, 1)
        s.fail(JOB, step, f"reason {step}")
    assert states(s) == {3: "failed", 4: "failed", 5: "failed", 6: "failed"}


def test_readable_refuses_a_step_not_held_naming_the_complete_ones() -> None:
    s = store()
    with refused(codes.NOT_FOUND, "no checkpoint of step 3", "complete here: none"):
        s.readable(JOB, 3)
    write(s, 1, 1, complete=True)
    write(s, 2, 1, complete=True)
    write(s, 4, 1)
    with refused(codes.NOT_FOUND, "no checkpoint of step 3", "complete here: [1, 2]"):
        s.readable(JOB, 3)
    with refused(codes.FAILED_PRECONDITION, "checkpoint step 4", "is writing, not complete"):
        s.readable(JOB, 4)


def test_object_returns_the_bytes_or_names_the_holders() -> None:
    s = store()
    c = write(s, 1, 5, complete=False)
    s.complete(JOB, 1, (2, 4))
    c = s.readable(JOB, 1)
    assert torch.equal(s.object(c, "obj"), data(5, 1))
    del c.objects[METADATA_KEY]
    with refused(codes.NOT_FOUND, "holds no metadata", "nodes [2, 4]"):
        s.object(c, METADATA_KEY)
    with refused(codes.NOT_FOUND, "holds no object 'elsewhere'", "nodes [2, 4]"):
        s.object(c, "elsewhere")


def test_held_bytes_return_to_zero_once_every_job_is_dropped() -> None:
    s = store()
    write(s, 1, 10, complete=True)
    write(s, 2, 20, complete=True)
    write(s, 3, 30)
    c = s.begin(JOB, 4, 1, 0, 1)
    s.put(c, "x", data(7))
    s.fail(JOB, 3, "gone")
    write(s, 1, 100, job="other", complete=True)
    assert s.held == 11 + 21 + 7 + 101
    assert s.held == sum(c.nbytes for steps in s.jobs.values() for c in steps.values())
    s.drop_job(JOB)
    assert s.held == 101 and JOB not in s.jobs and s.job_bytes(JOB) == 0
    s.drop_job("other")
    s.drop_job("never-seen")
    assert s.held == 0 and s.jobs == {}


def test_lose_on_a_node_that_held_nothing_records_a_failed_step_with_the_reason() -> None:
    s = store()
    s.lose(JOB, 8, "the objects of node(s) [1] were on no surviving node")
    assert states(s) == {8: "failed"}
    assert s.jobs[JOB][8].reason == "the objects of node(s) [1] were on no surviving node"
    with refused(codes.FAILED_PRECONDITION, "checkpoint step 8", "were on no surviving node"):
        s.readable(JOB, 8)
    assert s.held == 0


def test_lose_on_a_node_that_held_the_step_frees_it() -> None:
    s = store()
    write(s, 1, 10, complete=True)
    write(s, 2, 20, complete=True)
    s.lose(JOB, 2, "lost")
    assert states(s) == {1: "complete", 2: "failed"}
    assert s.held == 11 and s.last_complete(JOB) == 1


def test_install_replaces_what_was_held_of_the_step_and_trims_older_steps() -> None:
    s = store()
    write(s, 1, 10, complete=True)
    write(s, 2, 20, complete=True)
    write(s, 3, 30)  # a partial step 3 here: replaced by the recovered one
    recovered = Checkpoint(3, 0, objects={"obj": data(64, 9), METADATA_KEY: data(2)}, state="complete",
                           holders=(1, 0))
    s.install(JOB, recovered)
    assert states(s) == {2: "complete", 3: "complete"}
    assert s.jobs[JOB][3] is recovered
    assert s.held == 21 + 66 == s.job_bytes(JOB)
    assert s.last_complete(JOB) == 3
    s.install("new-job", Checkpoint(1, 0, objects={"o": data(4)}, state="complete"))
    assert s.held == 21 + 66 + 4


# ---------------------------------------------------------------------- keys


def test_an_object_put_twice_is_refused_and_not_counted_twice() -> None:
    s = store()
    c = s.begin(JOB, 1, 1, 0, 1)
    s.put(c, "a/0", data(10))
    with refused(codes.INVALID_ARGUMENT, "checkpoint step 1", "object 'a/0' was put twice"):
        s.put(c, "a/0", data(20))
    assert s.held == 10 and c.objects["a/0"].numel() == 10


@pytest.mark.parametrize("key", ["line\nbreak", "tab\there", "nul\x00", "x" * (MAX_KEY_CHARS + 1)])
def test_a_key_too_long_or_not_printable_is_refused(key: str) -> None:
    s = store()
    c = s.begin(JOB, 1, 1, 0, 1)
    with refused(codes.INVALID_ARGUMENT, f"at most {MAX_KEY_CHARS} printable characters"):
        s.put(c, key, data(1))
    assert c.objects == {} and s.held == 0


def test_the_longest_printable_key_and_the_metadata_key_are_taken() -> None:
    check_key("k" * MAX_KEY_CHARS)
    check_key(METADATA_KEY)
    check_key("model.layers.0.weight/[0, 128]")


class Segment:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def with_segment(c: Checkpoint) -> Segment:
    segment = Segment()
    c.segments["s"] = segment
    c.places["obj"] = ("s", 0)
    return segment


def test_every_way_of_freeing_a_checkpoint_closes_its_segments_once() -> None:
    s = store()
    trimmed = with_segment(write(s, 1, 4, complete=True))
    freed_for_room = with_segment(write(s, 2, 4, complete=True))
    failed = with_segment(write(s, 3, 4))
    s.fail(JOB, 3, "no")
    assert failed.closed == 1 and s.jobs[JOB][3].segments == {} and s.jobs[JOB][3].places == {}
    s.fail(JOB, 3, "again")
    assert failed.closed == 1
    write(s, 4, 4, complete=True)  # trims step 1 (step 2 is the one before)
    assert trimmed.closed == 1 and freed_for_room.closed == 0
    assert 3 not in s.jobs[JOB] and failed.closed == 1  # the failed step below went too, closed once only
    s.max_job_bytes = s.job_bytes(JOB) + 1
    s.room(JOB, 2)  # frees step 2, the older kept complete step
    assert freed_for_room.closed == 1
    replaced = with_segment(write(s, 5, 4))
    s.install(JOB, Checkpoint(5, 0, objects={"obj": data(4)}, state="complete"))
    assert replaced.closed == 1
    kept = [with_segment(c) for c in s.jobs[JOB].values()]
    s.drop_job(JOB)
    assert [x.closed for x in kept] == [1] * len(kept) and s.held == 0


def test_room_frees_every_older_complete_step_it_needs_and_refuses_without_freeing_when_that_cannot_do():
    s = store(max_job_bytes=100)
    write(s, 1, 29, complete=True)
    write(s, 5, 29, complete=True)
    c = Checkpoint(3, 1, state="complete")
    s.put(c, "obj", data(29))
    s.put(c, METADATA_KEY, data(1), own=False)
    s.jobs[JOB][3] = c  # three complete steps (an install below the newest can leave them)
    with refused(codes.RESOURCE_EXHAUSTED, "--checkpoint-job-bytes"):
        s.room(JOB, 80)  # even with 1 and 3 freed, 30 + 80 > 100
    assert states(s) == {1: "complete", 3: "complete", 5: "complete"}  # nothing freed for nothing
    s.room(JOB, 65)  # fits once 1 and 3 are freed
    assert states(s) == {5: "complete"}
    assert s.job_bytes(JOB) + 65 <= 100


def test_a_lost_step_is_refused_to_a_writer_with_its_reason_not_a_world_size_mismatch():
    s = store()
    s.lose(JOB, 9, "checkpoint step 9 of job 'job-a' is lost: node(s) [1]")
    with refused(codes.FAILED_PRECONDITION, "is failed already", "node(s) [1]"):
        s.begin(JOB, 9, 1, 0, 1)
