"""CUDA buffers from the daemon's pool, opened by a trainer in another process: runs only where a GPU is present.

Run on the lent GPU machine with: PYTHONPATH=. python3 -m pytest -q tests/gpu/test_cuda_buffers.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.buffers.trainer import ROOT, Trainer
from tests.helpers import poll_for
from tests.subprocess_env import with_project
from zend.buffers import BufferServer, CudaBuffer, SessionInfo, SharedBufferError

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.timeout(180)]

OPEN_AND_WRITE = """
import json, sys, torch
from zend.buffers import CudaBuffer
buf = CudaBuffer.open(json.loads(sys.stdin.readline()))
before = buf.view(torch.float32, 0, 4).cpu().tolist()
buf.view(torch.float32, 0, 4).copy_(torch.arange(4, dtype=torch.float32, device=buf.device) + 10)
torch.cuda.synchronize()
print(json.dumps({"before": before, "device": buf.device}), flush=True)
buf.close()
"""


class Daemon:
    def __init__(self, path: str) -> None:
        self.closed = threading.Event()
        self.server = BufferServer(path, lambda s, t: SessionInfo(s, "job"),
                                   on_session_closed=lambda s: self.closed.set(), cuda_pool=True)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(str(tmp_path / "b.sock"))
    d.server.start()
    try:
        yield d
    finally:
        d.server.close()


@pytest.fixture
def trainer(daemon: Daemon) -> Iterator[Trainer]:
    t = Trainer(daemon.server.path, "alice", timeout_s=60)
    try:
        yield t
    finally:
        t.kill()


@pytest.mark.daemon
def test_trainer_and_daemon_share_a_cuda_buffer(daemon: Daemon, trainer: Trainer) -> None:
    server = daemon.server
    reply = trainer.call(cmd="alloc", nbytes=1 << 20, device="cuda:0")
    assert reply["device"] == "cuda:0" and server.pool_bytes == 1 << 20
    buf = server.get("alice", reply["buffer"])
    assert isinstance(buf, CudaBuffer) and buf.device == "cuda:0"
    assert int(buf.view(torch.uint8, 0, 1 << 20).sum()) == 0, "a new buffer is zeroed"

    trainer.call(cmd="write", buffer=buf.buffer_id, offset=256, values=[1.0, 2.0, 3.0])
    view = buf.view(torch.float32, 256, 3)
    assert view.is_cuda and view.cpu().tolist() == [1.0, 2.0, 3.0]
    view[0] = -1.0
    torch.cuda.synchronize()
    assert trainer.call(cmd="read", buffer=buf.buffer_id, offset=256, count=3)["values"] == [-1.0, 2.0, 3.0]

    assert trainer.exit() == 0
    assert daemon.closed.wait(10)
    poll_for(lambda: server.pool_bytes == 0, 10, "the CUDA pool empty", interval_s=0.02)


@pytest.mark.daemon
def test_killed_trainer_ends_its_cuda_session(daemon: Daemon, trainer: Trainer) -> None:
    server = daemon.server
    trainer.call(cmd="alloc", nbytes=4 << 20, device="cuda:0")
    trainer.call(cmd="alloc", nbytes=4096, device="cpu")
    assert server.pool_bytes == (4 << 20) + 4096
    os.kill(trainer.proc.pid, signal.SIGKILL)
    assert daemon.closed.wait(10)
    poll_for(lambda: server.pool_bytes == 0, 10, "the CUDA pool empty", interval_s=0.02)
    assert server.sessions == []


@pytest.mark.daemon
def test_export_opens_in_another_process() -> None:
    buf = CudaBuffer.create(4096, "direct", "cuda:0")
    try:
        handle = buf.export()
        assert handle == buf.export(), "exported once"
        json.dumps(handle)  # JSON-able
        env = with_project()
        done = subprocess.run([sys.executable, "-c", OPEN_AND_WRITE], input=json.dumps(handle) + "\n", text=True,
                              capture_output=True, cwd=ROOT, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"before": [0.0, 0.0, 0.0, 0.0], "device": "cuda:0"}
        assert buf.view(torch.float32, 0, 4).cpu().tolist() == [10.0, 11.0, 12.0, 13.0]
    finally:
        buf.close()


HAND_OFFS = """
import json, sys, time, torch
from zend.buffers import CudaBuffer
started = time.perf_counter()
buf = CudaBuffer.open(json.loads(sys.stdin.readline()))
opened = time.perf_counter() - started
data = torch.randn(1 << 18, device=buf.device)  # 1 MiB
times = []
for i in range(50):
    t = time.perf_counter()
    buf.view(torch.float32, 0, 1 << 18).copy_(data)
    buf.publish()  # what a trainer does before it submits a step
    times.append(time.perf_counter() - t)
print(json.dumps({"open_s": opened, "hand_off_s": sorted(times)[25]}), flush=True)
buf.close()
"""


@pytest.mark.daemon
def test_ipc_hand_off_latency(gpu_figure) -> None:  # type: ignore[no-untyped-def]
    """Opening a buffer's IPC handle in a trainer process, and one 1 MiB write published to the daemon."""
    buf = CudaBuffer.create(1 << 20, "latency", "cuda:0")
    try:
        done = subprocess.run([sys.executable, "-c", HAND_OFFS], input=json.dumps(buf.export()) + "\n", text=True,
                              capture_output=True, cwd=ROOT, env=with_project(), timeout=120)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout.splitlines()[-1])
        gpu_figure("IPC handle opened in the trainer", got["open_s"] * 1e3, "ms")
        gpu_figure("1 MiB written and published (median of 50)", got["hand_off_s"] * 1e6, "us")
        started = time.perf_counter()
        buf.view(torch.float32, 0, 4).fill_(1.0)
        buf.publish()  # what the daemon does before it answers
        gpu_figure("daemon's publish after a small write", (time.perf_counter() - started) * 1e6, "us")
    finally:
        buf.close()


@pytest.mark.inprocess
def test_each_buffer_is_alone_in_its_cuda_allocation() -> None:
    """An IPC handle opens a whole allocation: two buffers must never share one."""
    bufs = [CudaBuffer.create(n, f"b{n}", "cuda:0") for n in (512, 512, 3 << 20)]
    try:
        handles = [b.export() for b in bufs]
        assert len({h["handle"] for h in handles}) == 3
        assert all(h["storage_offset_bytes"] == 0 for h in handles)
    finally:
        for b in bufs:
            b.close()


@pytest.mark.inprocess
def test_cuda_views_and_refusals_name_the_values() -> None:
    buf = CudaBuffer.create(64, "c1", "cuda:0")
    try:
        with pytest.raises(SharedBufferError, match=r"offset=2 is not aligned"):
            buf.view(torch.float32, 2, 1)
        with pytest.raises(SharedBufferError, match=r"offset=60, count=2 torch.float32 ends at byte 68, "
                                                    r"past nbytes=64"):
            buf.view(torch.float32, 60, 2)
        assert buf.view(torch.float64, 56, 1).is_cuda
        with pytest.raises(SharedBufferError, match=r"no file descriptor"):
            buf.fileno()
        with pytest.raises(SharedBufferError, match=r"cuda:99"):
            CudaBuffer.create(64, "c2", "cuda:99")
    finally:
        buf.close()
    with pytest.raises(SharedBufferError, match=r"buffer 'c1' is closed"):
        buf.view(torch.uint8, 0, 1)
