"""In-memory checkpoints on one real daemon: only the job's token reaches its checkpoints, what a trainer
maps cannot be written, the memory bound is named when it refuses, and old or abandoned steps are freed."""

from __future__ import annotations

import os

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zen
import zen.checkpoint as zc
from torch.distributed.checkpoint.api import CheckpointException

from tests.helpers import node_status, poll_for
from zend.buffers.shared import SharedBuffer, SharedBufferError

pytestmark = pytest.mark.daemon


def client(c, job: str) -> zen.Client:  # type: ignore[no-untyped-def]
    return zen.Client(c.socket_dir(0), job=job, token=c.token(job), local_rank=0, local_world_size=1, timeout_s=30)


def save(z: zen.Client, step: int, nbytes: int = 1 << 16) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(nbytes // 4, dtype=torch.float32) + step}
    dcp.save(state, storage_writer=zc.MemoryWriter(step, z), no_dist=True)
    return state


def complete(c, job: str, step: int) -> None:  # type: ignore[no-untyped-def]
    poll_for(lambda: [x for x in node_status(c, 0, operator=True).checkpoints
                      if x.job_id == job and x.last_complete_step == step], 20, f"step {step} of {job} complete")


@pytest.fixture
def one_node(fresh_cluster):  # type: ignore[no-untyped-def]
    return fresh_cluster(1, extra=["--log-format", "text", "--checkpoint-memory-bytes", str(1 << 20)])


def test_another_jobs_trainer_reaches_none_of_a_jobs_checkpoints(one_node):
    c = one_node
    a, b = client(c, "a"), client(c, "b")
    try:
        save(a, 3)
        complete(c, "a", 3)
        assert b.session.list_checkpoints() == []
        with pytest.raises(grpc.RpcError) as info:
            b.session.locate_checkpoint(3, ["w@0"])
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'b' has no checkpoint of step 3" in info.value.details()
        segment = a.session.locate_checkpoint(3, ["w@0"])[0].segment
        assert segment
        with pytest.raises(SharedBufferError, match="has no checkpoint of step 3"):
            b.session.map_checkpoint_segment(3, segment)  # job b's session, job a's segment id
        # a's own trainer reads it back exactly
        out = {"w": torch.zeros(1 << 14)}
        dcp.load(out, storage_reader=zc.MemoryReader(client=a), no_dist=True)
        torch.testing.assert_close(out["w"], torch.arange(1 << 14, dtype=torch.float32) + 3, rtol=0, atol=0)
    finally:
        a.close()
        b.close()


def test_a_mapped_checkpoint_segment_cannot_be_written(one_node):
    c = one_node
    a = client(c, "a")
    try:
        save(a, 1)
        complete(c, "a", 1)
        place = a.session.locate_checkpoint(1, ["w@0"])[0]
        segment = a.session.map_checkpoint_segment(1, place.segment)
        try:
            fd = os.dup(segment.fileno())
            with pytest.raises(SharedBufferError, match="cannot map"):
                SharedBuffer.attach(fd, int(place.segment_bytes), "rw")  # a writable mapping is refused
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            os.close(fd)
        finally:
            segment.close()
        out = {"w": torch.zeros(1 << 14)}
        dcp.load(out, storage_reader=zc.MemoryReader(1, a), no_dist=True)
        assert torch.equal(out["w"], torch.arange(1 << 14, dtype=torch.float32) + 1)
    finally:
        a.close()


def test_the_memory_bound_is_named_and_old_and_abandoned_steps_are_freed(one_node):
    c = one_node
    a = client(c, "a")
    try:
        with pytest.raises(CheckpointException) as info:
            save(a, 1, nbytes=2 << 20)  # 2 MiB against a bound of 1 MiB
        refusal = info.value.failures[0][0]  # DCP gathers (error, traceback) per rank
        assert isinstance(refusal, zen.OutOfResources) and "--checkpoint-memory-bytes" in str(refusal), refusal
        # a step whose trainer went away half-written stays "writing" until a newer one completes
        buf = a.session.buffers.alloc(4096)
        a.session.put_checkpoint(2, buf.buffer_id, [("x", 0, 4096)], 0, 1, True, False)
        a.session.buffers.free(buf.buffer_id)
        for step in (3, 4, 5):
            save(a, step, nbytes=200 << 10)
            complete(c, "a", step)
        held = next(x for x in node_status(c, 0, operator=True).checkpoints if x.job_id == "a")
        assert list(held.steps) == [4, 5]  # the newest and the one before; 2 (abandoned) and 3 freed
        assert held.bytes < 2 * (200 << 10) + (64 << 10)
    finally:
        a.close()


def test_a_refused_put_leaves_nothing_half_kept(one_node):
    c = one_node
    a = client(c, "a")
    try:
        buf = a.session.buffers.alloc(8192)
        with pytest.raises(grpc.RpcError) as info:  # the same key twice in one put
            a.session.put_checkpoint(4, buf.buffer_id, [("x", 0, 4096), ("x", 4096, 4096)], 0, 1, True, False)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "put twice" in info.value.details()
        a.session.buffers.free(buf.buffer_id)
        step = next(x for x in a.session.list_checkpoints() if x.step == 4)
        assert (step.state, step.bytes) == ("failed", 0) and "refused" in step.reason
    finally:
        a.close()
